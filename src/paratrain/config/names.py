"""The names the layout fields allow (no imports: every other config module and the planner read them)."""

# Pipeline schedules (torch.distributed.pipelining): one stage per rank, several (virtual) stages per rank, and
# those of them that place the stages V-shaped (rank r holds stages r and 2pp-1-r). The planner models each.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
PP_SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
DP_KINDS = ("ddp", "fsdp", "hsdp")
RECOMPUTE = ("none", "selective", "full")
