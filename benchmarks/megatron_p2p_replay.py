"""Event replay of Megatron-Core's pipeline schedules (ranks' compute streams, rendezvous p2p of time c).
Interleaved: forward_backward_pipelining_with_interleaving at core_r0.14-0.17 (overlap_p2p_comm with and without;
overlap_p2p_comm_warmup_flush False); fsend_wait: core >= 0.18 (PR #4047, each forward send waited at once).
1F1B: forward_backward_pipelining_without_interleaving. The closed forms it checks:
plan.pipeline.overlapped_p2p_path_s (tests/test_plan_model.py replays one layout)."""

import functools


def exchange(ops, sends, recvs):
    """A blocking exchange appended to one rank's program: post the sends, then the receives, then wait for all of
    them (None: no peer on that side)."""
    keys = [x for x in sends + recvs if x]
    ops.extend(("ps", x) for x in sends if x)
    ops.extend(("pr", x) for x in recvs if x)
    ops.extend(("w", x) for x in keys)


def async_pass(ops, duration, name, pending_recv, send, recv, prev_send):
    """One steady-state pass under overlap_p2p_comm appended to a rank's program: wait for the receive it needs,
    compute, post its send and the next receive, wait for the previous pass's send. Returns (the receive now
    pending, the send now in flight); None: no peer on that side."""
    if pending_recv:
        ops.append(("w", pending_recv))
    ops.append(("c", duration, name))
    if send:
        ops.append(("ps", send))
    if recv:
        ops.append(("pr", recv))
    if prev_send:
        ops.append(("w", prev_send))
    return recv, send


def chunk_mb(k, p, v, forward):
    g = k % (p * v)
    j = g // p
    if not forward:
        j = v - 1 - j
    return j, (k // (p * v)) * p + k % p


def interleaved_programs(p, v, m, F, B, overlap, fsend_wait=False, combined_h=None):
    total = m * v
    progs = []
    S = p * v
    for r in range(p):
        ops = []
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        allwarm = warm == total
        rem = total - warm

        def fwd_keys(k, r=r):
            j, i = chunk_mb(k, p, v, True)
            s = j * p + r
            return (("F", s - 1, i) if s > 0 else None), (("F", s, i) if s < S - 1 else None)

        def bwd_keys(k, r=r):
            j, i = chunk_mb(k, p, v, False)
            s = j * p + r
            return (("B", s + 1, i) if s < S - 1 else None), (("B", s, i) if s > 0 else None)

        ex = functools.partial(exchange, ops)

        # recv_forward of k=0
        ex([], [fwd_keys(0)[0]])
        prev_send_next = prev_send_prev = None
        pending_recv_f = pending_recv_b = None
        for k in range(warm):
            ops.append(("c", F, "F"))
            out = fwd_keys(k)[1]
            nxt_in = fwd_keys(k + 1)[0] if k + 1 < total else None
            if not overlap and k == warm - 1 and not allwarm:
                ex([out], [nxt_in, bwd_keys(0)[0]])
            else:
                ex([out], [nxt_in])
            if overlap and k == warm - 1 and not allwarm:
                g = bwd_keys(0)[0]
                if g:
                    ops.append(("pr", g))
                    pending_recv_b = g
        for k in range(rem):
            fk = k + warm
            if overlap and combined_h is not None:  # combined 1F1B (EP A2A overlap): both exchanges at the end
                for x in (pending_recv_f, pending_recv_b):  # pre_forward, pre_backward
                    if x:
                        ops.append(("w", x))
                pending_recv_f = pending_recv_b = None
                ops.append(("c", F + B - combined_h, "FB"))
                out, gout = fwd_keys(fk)[1], bwd_keys(k)[1]
                nxt_in = fwd_keys(fk + 1)[0] if k < rem - 1 else None
                gin = bwd_keys(k + 1)[0] if k + 1 < total else None
                for send, recv, prev in ((out, nxt_in, prev_send_next), (gout, gin, prev_send_prev)):
                    if send:
                        ops.append(("ps", send))
                    if recv:
                        ops.append(("pr", recv))
                    if prev:
                        ops.append(("w", prev))
                pending_recv_f, pending_recv_b = nxt_in, gin
                prev_send_next, prev_send_prev = out, gout
                ops.append(("c", combined_h, "Bdw"))  # the first layer's delayed attention wgrad
            elif overlap:
                out = fwd_keys(fk)[1]
                nxt_in = fwd_keys(fk + 1)[0] if k < rem - 1 else None
                pending_recv_f, prev_send_next = async_pass(ops, F, "F", pending_recv_f, out, nxt_in, prev_send_next)
                if fsend_wait and out:
                    ops.append(("w", out))
                    prev_send_next = None
                gout = bwd_keys(k)[1]
                gin = bwd_keys(k + 1)[0] if k + 1 < total else None
                pending_recv_b, prev_send_prev = async_pass(ops, B, "B", pending_recv_b, gout, gin, prev_send_prev)
            else:
                ops.append(("c", F, "F"))
                ops.append(("c", B, "B"))
                out = fwd_keys(fk)[1]
                nxt_in = fwd_keys(fk + 1)[0] if k < rem - 1 else None
                gout = bwd_keys(k)[1]
                gin = bwd_keys(k + 1)[0] if k + 1 < total else None
                ex([out, gout], [nxt_in, gin])
        # cooldown
        for x in (prev_send_prev, pending_recv_b, prev_send_next):
            if x:
                ops.append(("w", x))
        if pending_recv_b is None and allwarm:
            ex([], [bwd_keys(0)[0]])
        pending_recv_b = None
        for k in range(rem, total):
            ops.append(("c", B, "B"))
            gout = bwd_keys(k)[1]
            gin = bwd_keys(k + 1)[0] if k + 1 < total else None
            ex([gout], [gin])
        progs.append(ops)
    return progs


def onef1b_programs(p, m, F, B):
    progs = []
    for r in range(p):
        ops = []
        warm = min(p - r - 1, m)
        rem = m - warm

        def fin(i, r=r):
            return ("F", r - 1, i) if r > 0 else None

        def fout(i, r=r):
            return ("F", r, i) if r < p - 1 else None

        def bin_(i, r=r):
            return ("B", r + 1, i) if r < p - 1 else None

        def bout(i, r=r):
            return ("B", r, i) if r > 0 else None

        ex = functools.partial(exchange, ops)

        for i in range(warm):
            ex([], [fin(i)])
            ops.append(("c", F, "F"))
            ex([fout(i)], [])
        if rem > 0:
            ex([], [fin(warm)])
        for k in range(rem):
            ops.append(("c", F, "F"))
            ex([fout(warm + k)], [bin_(k)])
            ops.append(("c", B, "B"))
            if k == rem - 1:
                ex([bout(k)], [])
            else:
                ex([bout(k)], [fin(warm + k + 1)])
        for i in range(rem, m):
            ex([], [bin_(i)])
            ops.append(("c", B, "B"))
            ex([bout(i)], [])
        progs.append(ops)
    return progs


def run(progs, c):
    n = len(progs)
    t = [0.0] * n
    pc = [0] * n
    sp, rp = {}, {}
    busy = [0.0] * n
    while True:
        moved = False
        for r in range(n):
            ops = progs[r]
            while pc[r] < len(ops):
                op = ops[pc[r]]
                if op[0] == "c":
                    t[r] += op[1]
                    busy[r] += op[1]
                elif op[0] == "ps":
                    sp[op[1]] = t[r]
                elif op[0] == "pr":
                    rp[op[1]] = t[r]
                else:
                    key = op[1]
                    if key not in sp or key not in rp:
                        break
                    t[r] = max(t[r], max(sp[key], rp[key]) + c)
                pc[r] += 1
                moved = True
        if all(pc[r] == len(progs[r]) for r in range(n)):
            return max(t)
        if not moved:
            raise RuntimeError(
                "deadlock "
                + str([(r, pc[r], progs[r][pc[r]]) for r in range(n) if pc[r] < len(progs[r])][:4])
            )


if __name__ == "__main__":
    for p, v, m in [(4, 5, 32), (8, 8, 32), (8, 5, 16), (16, 8, 16), (4, 5, 64)]:
        F, B = 1.0, 2.0
        base = run(interleaved_programs(p, v, m, F, B, False), 0.0)
        theory = m * v * (F + B) + (p - 1) * (F + B)
        print(f"p{p} v{v} m{m}: c=0 sim {base:.1f} theory {theory:.1f}")
        for c in (0.1, 0.3, 0.6, 1.0, 2.5):
            no = run(interleaved_programs(p, v, m, F, B, False), c)
            ov = run(interleaved_programs(p, v, m, F, B, True), c)
            ovw = run(interleaved_programs(p, v, m, F, B, True, True), c)
            planner = theory + m * 2 * v * c
            print(
                f"   c={c}: planner {planner:.1f} (+{planner - theory:.1f})  no-overlap +{no - base:.1f}  overlap +{ov - base:.1f}  overlap+fwdwait +{ovw - base:.1f}"
            )
    for p, m in [(4, 32), (8, 16)]:
        F, B = 1.0, 2.0
        base = run(onef1b_programs(p, m, F, B), 0.0)
        for c in (0.1, 0.5):
            s = run(onef1b_programs(p, m, F, B), c)
            print(
                f"1f1b p{p} m{m} c{c}: base {base:.1f} theory {(m + p - 1) * (F + B):.1f} +{s - base:.2f}  planner +{2 * m * c:.2f}  (m+p-1)*2c {2 * (m + p - 1) * c:.2f}"
            )
