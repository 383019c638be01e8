"""Hardware catalog: built-in data complete and sourced, user files, one-line errors for malformed files."""

from __future__ import annotations

import pytest

from paratrain.cli import main
from paratrain.hardware.catalog import CatalogError, load_catalog, resolve_system

REQUIRED_CHIPS = ["trainium1", "trainium2", "trainium3", "trainium4", "a100-40gb", "a100-80gb", "h100", "h200", "b200"]
REQUIRED_SYSTEMS = ["trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge", "trn2-ultraserver", "trn3-ultraserver",
                    "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5en.48xlarge", "p6-b200.48xlarge"]

USER_SYSTEM = """
[interconnects.test-link]
endpoint = "device"
bw_gbytes_per_s = 100.0
latency_us = 0.0
bw_eff = 1.0
source = "test"

[interconnects.test-net]
endpoint = "node"
bw_gbytes_per_s = 50.0
latency_us = 0.0
bw_eff = 1.0
source = "test"

[chips.test-chip]
vendor = "test"
bf16_tflops = 100.0
hbm_bytes = 10000000000
hbm_bw_gbytes_per_s = 1000.0
cores_per_chip = 1
source = "test"
[chips.test-chip.efficiency]
matmul_eff_max = 1.0
kernel_overhead_s = 0.0
memory_bw_eff = 1.0
source = "test"

[systems.test-box]
chip = "test-chip"
chips_per_node = 8
devices_per_chip = 1
device_unit = "test device"
tiers = [
  { name = "intra-node", interconnect = "test-link", domain_devices = 8 },
  { name = "scale-out", interconnect = "test-net", domain_devices = 0 },
]
source = "test"
[systems.test-box.prices]
on_demand_usd_per_hour = 10.0
source = "test"
[systems.test-box.efficiency]
dp_overlap = 0.0
tp_overlap = 0.0
memory_usable_fraction = 1.0
source = "test"
"""


def test_builtin_catalog_has_required_entries_with_sources():
    cat = load_catalog()
    for name in REQUIRED_CHIPS:
        chip = cat.chip(name)
        assert chip.source.strip() and chip.efficiency.source.strip()
        assert chip.bf16_tflops > 0 and chip.hbm_bytes > 0
    for name in REQUIRED_SYSTEMS:
        system = cat.system(name)
        assert system.source.strip() and system.efficiency.source.strip() and system.prices.source.strip()
        for tier in system.tiers:
            assert tier.interconnect.source.strip()
    assert cat.chip("trainium4").status == "announced"


def test_every_link_parameter_names_its_source():
    """The link's `source` covers its bandwidth; the planner parameters beside it (per-step latency, achieved
    fraction of bandwidth, per-call overhead) each need their own line: measured, calibrated or an assumption."""
    for link in load_catalog().interconnects.values():
        needed = ["latency_us", "bw_eff"] + (["collective_overhead_us"] if link.collective_overhead_us else []) \
            + (["ll128_latency_us"] if link.ll128_latency_us else [])
        for key in needed:
            assert link.sources.get(key, "").strip(), f"{link.name}.{key}"


def test_published_numbers_are_the_catalog_numbers():
    cat = load_catalog()
    trn1 = cat.system("trn1.32xlarge")
    assert trn1.devices_per_node == 32  # a rank is a NeuronCore: 16 chips x 2
    assert trn1.device_memory_bytes == 16 * 2**30
    assert trn1.prices.on_demand_usd_per_hour == pytest.approx(21.50)
    trn3 = cat.system("trn3-ultraserver")
    # the source documents' system figure: 144 chips x 2.52 PF FP8 = 362 PF
    assert trn3.chips_per_node * trn3.chip.fp8_tflops / 1000 == pytest.approx(362.4, rel=0.01)
    assert trn3.chip.hbm_bw_gbytes_per_s == 4900
    assert cat.system("p4d.24xlarge").prices.on_demand_usd_per_hour == pytest.approx(21.957642)
    assert cat.chip("h100").power_w == 700
    # GB200 NVL72's rack figures (with sparsity): 720 PF FP8, 13.4 TB HBM3e at 576 TB/s, one NVLink domain of 72
    gb = cat.system("dgx-gb200")
    assert 72 * gb.chip.fp8_tflops * 2 / 1000 == pytest.approx(720) and gb.chip.bf16_tflops * 2 == gb.chip.fp8_tflops
    assert 72 * gb.chip.hbm_bytes == pytest.approx(13.4e12, rel=0.01) and 72 * gb.chip.hbm_bw_gbytes_per_s == 576e3
    assert gb.tiers[0].domain_devices == 72 and gb.devices_per_node == 4


def test_tier_bandwidth_is_shared_by_the_devices_of_its_endpoint():
    trn1 = load_catalog().system("trn1.32xlarge")
    efa = trn1.tiers[-1]
    expected = 100e9 * efa.interconnect.bw_eff / 32  # 800 Gbps per node, 32 NeuronCores
    assert efa.per_device_bw_bytes_per_s(trn1) == pytest.approx(expected)


def test_meta_llama3_cluster_slows_only_what_crosses_its_pods():
    """Dubey et al. 2024 sec. 3.3.1: 3,072-GPU pods, 1:7 oversubscribed between them. A group inside a pod runs as on
    a non-blocking 400 Gb/s-per-GPU fabric (dgx-h100: the same chip, NVLink and per-GPU bandwidth); a group spanning
    pods pays the aggregation layer's 1/7 share for the part of the ring that leaves the pod."""
    from paratrain.plan.collectives import collective_time_s

    cat = load_catalog()
    meta, dgx = cat.system("meta-llama3-h100"), cat.system("dgx-h100")
    assert meta.chip.name == dgx.chip.name and [t.domain_devices for t in meta.tiers] == [8, 3072, 0]
    pod, between = meta.tiers[1].per_device_bw_bytes_per_s(meta), meta.tiers[2].per_device_bw_bytes_per_s(meta)
    assert pod / between == pytest.approx(7.0, rel=1e-6)
    inside = [collective_time_s(s, "reducescatter", 1e9, 64, 8) for s in (meta, dgx)]  # 512 GPUs: one pod
    assert inside[0] == pytest.approx(inside[1], rel=1e-12)
    across = [collective_time_s(s, "reducescatter", 1e9, 64, 128) for s in (meta, dgx)]  # 8,192 GPUs: 3 pods
    assert across[0] > 1.1 * across[1]  # hierarchical: only the 1/24 left after the pod-level step crosses


def test_user_directory_adds_a_system(tmp_path, monkeypatch):
    (tmp_path / "mine.toml").write_text(USER_SYSTEM)
    monkeypatch.setenv("PARATRAIN_HARDWARE_DIR", str(tmp_path))
    cat = load_catalog()
    assert "test-box" in cat.systems and "trn1.32xlarge" in cat.systems
    assert cat.system("test-box").devices_per_node == 8


def test_hardware_file_path_resolves(tmp_path):
    path = tmp_path / "box.toml"
    path.write_text(USER_SYSTEM)
    assert resolve_system(str(path)).name == "test-box"


@pytest.mark.parametrize("old,new,expect", [
    ("bf16_tflops = 100.0", "bf16_tflops = -5.0", "chips.test-chip.bf16_tflops = -5.0: must be a number > 0"),
    ('endpoint = "device"', 'endpoint = "rack"', "interconnects.test-link.endpoint = 'rack': must be one of device, chip, node"),
    ("dp_overlap = 0.0", "dp_overlap = 1.5", "systems.test-box.efficiency.dp_overlap = 1.5: must be a number in [0, 1]"),
    ('chip = "test-chip"', 'chip = "nope"', "systems.test-box.chip = 'nope': unknown; allowed:"),
    ("cores_per_chip = 1", "cores_per_chip = 1\nflops = 3", "chips.test-chip.flops: unknown field; allowed:"),
    ("cores_per_chip = 1", "cores_per_chip = 1\nfp8_block_scaled = 1", "chips.test-chip.fp8_block_scaled = 1: must be true or false"),
    ('source = "test"\n[chips.test-chip.efficiency]', '[chips.test-chip.efficiency]', "chips.test-chip.source: missing"),
    ('device_unit = "test device"', 'device_unit = "test device"\nhost_link_gbytes_per_s = 64',
     "systems.test-box.host_link_gbytes_per_s and host_link_source: each needs the other"),
])
def test_malformed_file_gives_one_clear_error(tmp_path, old, new, expect):
    assert old in USER_SYSTEM
    path = tmp_path / "bad.toml"
    path.write_text(USER_SYSTEM.replace(old, new, 1))
    with pytest.raises(CatalogError) as err:
        load_catalog([path])
    message = str(err.value)
    assert str(path) in message and expect in message
    assert "\n" not in message


def test_invalid_toml_and_unknown_system(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[systems.x\n")
    with pytest.raises(CatalogError, match="not valid TOML"):
        load_catalog([path])
    with pytest.raises(CatalogError, match="unknown system; known:"):
        load_catalog().system("trn9.huge")


def test_hardware_cli_list_and_show(capsys):
    import json

    assert main(["hardware", "list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {s["name"] for s in data["systems"]} >= set(REQUIRED_SYSTEMS)
    assert main(["hardware", "show", "trn1.32xlarge", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["devices_per_node"] == 32 and shown["tiers"][0]["name"] == "intra-chip"
    assert main(["hardware", "show", "nope"]) == 2
    assert "not a known system or chip" in capsys.readouterr().err


def test_calibrated_values_write_back_and_override(tmp_path, monkeypatch):
    """What `paratrain calibrate` will do: replace efficiency values, write, and the catalog picks them up."""
    import dataclasses

    from paratrain.hardware.catalog import write_catalog_file

    cat = load_catalog()
    chip = cat.chip("h100")
    new_eff = dataclasses.replace(chip.efficiency, matmul_eff_max=0.61, source="fitted in a test")
    link = dataclasses.replace(cat.interconnects["nvlink4"], bw_eff=0.66, source="fitted in a test")
    system = cat.system("p5.48xlarge")
    write_catalog_file(tmp_path / "calibrated.toml", chips=[dataclasses.replace(chip, efficiency=new_eff)],
                       interconnects=[link], systems=[system])
    monkeypatch.setenv("PARATRAIN_HARDWARE_DIR", str(tmp_path))
    again = load_catalog()
    assert again.chip("h100").efficiency.matmul_eff_max == 0.61
    assert again.chip("h100").bf16_tflops == chip.bf16_tflops and again.chip("h100").sources == chip.sources
    p5 = again.system("p5.48xlarge")
    assert p5.chip.efficiency.matmul_eff_max == 0.61 and p5.tiers[0].interconnect.bw_eff == 0.66
    assert p5.prices == system.prices and p5.efficiency == system.efficiency


def test_write_back_rejects_invalid_values(tmp_path):
    import dataclasses

    from paratrain.hardware.catalog import write_catalog_file

    chip = load_catalog().chip("h100")
    bad = dataclasses.replace(chip, efficiency=dataclasses.replace(chip.efficiency, matmul_eff_max=1.7))
    with pytest.raises(CatalogError, match="matmul_eff_max = 1.7"):
        write_catalog_file(tmp_path / "bad.toml", chips=[bad])
    assert not list(tmp_path.iterdir())


def test_output_into_a_closed_pipe_ends_quietly():
    """`paratrain hardware list | head -0`: the reader is gone before the first write; the command stops with
    128 + SIGPIPE and no traceback, as Unix tools do."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader from the start: the first write fails, deterministically
    try:
        proc = subprocess.run([sys.executable, "-m", "paratrain", "hardware", "list"], stdout=write_end,
                              stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr


@pytest.mark.parametrize("text,expect", [
    ('[prices.nope.on-demand]\nusd_per_node_hour = 1.0\nregion = "r"\nsource = "s"\ndate = "2026-01-01"\n',
     "prices.nope: no such system; known:"),
    ('[prices.test-box.spot]\nusd_per_node_hour = 1.0\nregion = "r"\nsource = "s"\n',
     "prices.test-box.spot.date: missing; must be a date YYYY-MM-DD or YYYY-MM"),
    ('[prices.test-box.spot]\nusd_per_node_hour = 1.0\nregion = "r"\nsource = "s"\ndate = "last week"\n',
     "prices.test-box.spot.date = 'last week': must be a date"),
    ('[prices.test-box.spot]\nusd_per_node_hour = -1.0\nregion = "r"\nsource = "s"\ndate = "2026-01"\n',
     "prices.test-box.spot.usd_per_node_hour = -1.0: must be a number > 0"),
    ('[prices.test-box.lease]\nusd_per_node_hour = 1.0\n', "prices.test-box.lease: unknown field; allowed: on-demand"),
    ('[prices.test-box]\nno_public_price = "none"\n[prices.test-box.spot]\nusd_per_node_hour = 1.0\nregion = "r"\n'
     'source = "s"\ndate = "2026-01"\n', "prices.test-box: has both prices (spot) and no_public_price"),
    ('[prices.test-box]\nconflicts = []\n', "prices.test-box: no price; allowed: at least one of on-demand"),
])
def test_malformed_price_table_gives_one_clear_error(tmp_path, text, expect):
    path = tmp_path / "prices.toml"
    path.write_text(USER_SYSTEM + "\n" + text)
    with pytest.raises(CatalogError) as err:
        load_catalog([path])
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_price_tables_merge_option_by_option(tmp_path):
    """A user file can add one purchase option to a system; the others stay; a later quote replaces one."""
    path = tmp_path / "mine.toml"
    path.write_text('[prices."p5.48xlarge".savings-1y]\nusd_per_node_hour = 40.0\nregion = "us-east-1"\n'
                    'source = "my quote"\ndate = "2026-12-01"\n'
                    '[prices."p5.48xlarge".spot]\nusd_per_node_hour = 20.0\nregion = "us-west-2"\n'
                    'source = "my quote"\ndate = "2026-12-01"\n')
    prices = load_catalog([path]).system("p5.48xlarge").prices
    assert prices.quote("savings-1y").usd_per_node_hour == 40.0 and prices.reserved_1yr_usd_per_hour == 40.0
    assert prices.quote("spot").region == "us-west-2"
    assert prices.on_demand_usd_per_hour == pytest.approx(55.04)  # untouched
    # the older [systems.X.prices] form still loads, its quotes marked as undated
    box = tmp_path / "box.toml"
    box.write_text(USER_SYSTEM)
    quote = load_catalog([box]).system("test-box").prices.quote("on-demand")
    assert quote.usd_per_node_hour == 10.0 and quote.date == "not given" and quote.source == "test"


def test_host_links_are_sourced_and_absent_where_unpublished():
    """The host link each device offloads activations over (System.host_link_gbytes_per_s, one direction): named
    with its source where set; GB200's NVLink-C2C share (900 GB/s both ways per superchip, 2 GPUs) above the PCIe
    Gen5 x16 of H100/H200 (64) above A100's Gen4 (32); no figure (so no offloading) for Trainium. Every PCIe host
    link has its switch uplink and host memory, each as numbers with a source or a reason there are none; the
    sourced uplinks: p5's one Gen4 x16 per GPU (AWS: PCIe Gen4 between CPU and GPU), p4d/p4de's Gen3 x16 and DGX
    A100's Gen4 x16 each shared by 2 GPUs; GB200 is its own path (no uplink or memory term)."""
    systems = load_catalog().systems
    links = {name: s.host_link_gbytes_per_s for name, s in systems.items()}
    assert all(systems[n].host_link_source for n, bw in links.items() if bw is not None)
    assert links["dgx-gb200"] == 900 / 2 / 2 and links["dgx-h100"] == links["p5en.48xlarge"] == 64
    assert links["p4d.24xlarge"] == links["dgx-a100-80gb"] == 32
    trainium = [n for n in systems if systems[n].chip.vendor == "aws"]
    assert trainium and all(links[n] is None for n in trainium)
    pcie = [s for s in systems.values() if s.host_link_gbytes_per_s is not None and s.host_link_kind == "pcie"]
    for s in pcie:
        assert (s.host_uplink_source and s.host_uplink_gbytes_per_s and s.host_uplink_devices) or s.host_uplink_unpublished
        assert (s.host_memory_source and s.host_memory_gbytes_per_s and s.host_memory_efficiency) \
            or s.host_memory_unpublished
    uplinks = {s.name: (s.host_uplink_gbytes_per_s, s.host_uplink_devices) for s in pcie}
    assert uplinks["p5.48xlarge"] == (32, 1)
    assert uplinks["p4d.24xlarge"] == uplinks["p4de.24xlarge"] == (16, 2) and uplinks["dgx-a100-80gb"] == (32, 2)
    gb200 = systems["dgx-gb200"]
    assert gb200.host_link_kind == "nvlink-c2c" and gb200.host_uplink_gbytes_per_s is None
    assert gb200.host_memory_gbytes_per_s is None


HOST_LINK = """host_link_gbytes_per_s = 64
host_link_source = "test"
"""
UPLINK = """host_uplink_gbytes_per_s = 64
host_uplink_devices = 2
host_uplink_source = "test"
"""
MEMORY = """host_memory_gbytes_per_s = 300
host_memory_efficiency = 0.8
host_memory_source = "test"
"""


@pytest.mark.parametrize("fields, message", [
    (HOST_LINK + MEMORY, r"systems\.test-box\.host_uplink_gbytes_per_s: missing; .* or host_uplink_unpublished"),
    (HOST_LINK + UPLINK, r"systems\.test-box\.host_memory_gbytes_per_s: missing"),
    (HOST_LINK + UPLINK.replace('host_uplink_source = "test"\n', "") + MEMORY,
     r"test-box\.host_uplink_source: missing"),
    (HOST_LINK + UPLINK + 'host_uplink_unpublished = "why"\n' + MEMORY,
     r"test-box\.host_uplink_unpublished and host_uplink_gbytes_per_s: both given"),
    (HOST_LINK + UPLINK.replace("= 2", "= 9") + MEMORY, r"host_uplink_devices = 9: more than the node's 8 devices"),
    (HOST_LINK + UPLINK.replace("= 2", "= 1.5") + MEMORY, r"host_uplink_devices = 1\.5: must be an integer > 0"),
    (HOST_LINK + UPLINK + MEMORY.replace("0.8", "1.2"), r"host_memory_efficiency = 1\.2: must be a number in \(0, 1\]"),
    (HOST_LINK + 'host_link_kind = "nvlink-c2c"\n' + UPLINK, r"host_uplink_gbytes_per_s: not used with host_link_kind"),
    (HOST_LINK + 'host_link_kind = "cxl"\n', r"host_link_kind = 'cxl': unknown; allowed: pcie, nvlink-c2c"),
    (UPLINK, r"host_uplink_gbytes_per_s: not used with no host_link_gbytes_per_s"),
])
def test_host_path_fields_error_clearly(tmp_path, fields, message):
    """A PCIe host link needs what the host side carries when every device copies at once (the switch uplink and
    the host memory, each with its source, or a reason there is none): each malformed or missing field is one
    error naming it and what is allowed."""
    box = tmp_path / "box.toml"
    box.write_text(USER_SYSTEM.replace('source = "test"\n[systems.test-box.prices]',
                                       fields + 'source = "test"\n[systems.test-box.prices]'))
    with pytest.raises(CatalogError, match=message):
        load_catalog([box])


def test_host_path_fields_load_and_round_trip(tmp_path):
    box = tmp_path / "box.toml"
    box.write_text(USER_SYSTEM.replace('source = "test"\n[systems.test-box.prices]',
                                       HOST_LINK + UPLINK + MEMORY + 'source = "test"\n[systems.test-box.prices]'))
    system = load_catalog([box]).system("test-box")
    assert (system.host_uplink_gbytes_per_s, system.host_uplink_devices, system.host_memory_efficiency) == (64, 2, 0.8)
    from paratrain.hardware.catalog import system_table
    table = system_table(system)
    assert table["host_uplink_devices"] == 2 and table["host_memory_gbytes_per_s"] == 300
    assert "host_link_kind" not in table and "host_uplink_unpublished" not in table


def test_power_capped_h100_peak_is_the_700w_part_scaled_by_what_the_cap_leaves():
    """h100-hbm2e-500w (Grand Teton's 500 W cap) is the 700 W H100 SXM's peak times the GEMM-bound throughput a cap
    leaves, from NVIDIA's MLPerf Inference v4.0 DGX H100 BERT-99.9 Offline runs at the default 700 W and at
    `nvidia-smi -pl 450` interpolated to 500 W (chips.toml sources), so the 0.64 calibrated at 700 W applies to
    both; FP8 keeps the Hopper 2:1, and the capped part sits inside torchtitan's NVL-SXM bracket (835-989)."""
    chips = load_catalog().chips
    sxm, capped = chips["h100"], chips["h100-hbm2e-500w"]
    at_450_w = 50998.9 / 62182.5
    at_500_w = at_450_w + (1.0 - at_450_w) * (500.0 - 450.0) / (700.0 - 450.0)
    assert capped.power_w == 500.0 and sxm.power_w == 700.0
    assert capped.bf16_tflops == pytest.approx(sxm.bf16_tflops * at_500_w, abs=0.5)
    assert capped.fp8_tflops == 2 * capped.bf16_tflops and 835.0 < capped.bf16_tflops < sxm.bf16_tflops
    assert capped.efficiency.matmul_eff_max == sxm.efficiency.matmul_eff_max
