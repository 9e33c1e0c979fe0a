import dataclasses
import math

import pytest

from tierflow import HardwareError, load_hardware, preset_names
from tierflow.hardware import hardware_from_toml


def test_all_presets_load():
    assert set(preset_names()) >= {"g10-a100", "a100-40g-pcie4-nvme", "h100-80g-pcie5-nvme", "rtx4090-24g", "cpu-dram-pmem"}
    for name in preset_names():
        hw = load_hardware(name)
        assert hw.offload_tiers, name


def test_g10_preset_is_g10s_headline_machine():
    hw = load_hardware("g10-a100")
    assert hw.device_capacity == 40 * 2**30
    assert hw.tier("host").capacity == 128 * 2**30
    assert hw.route_bandwidth("host", "gpu") == pytest.approx(15.754e9)
    assert hw.route_bandwidth("ssd", "gpu") == pytest.approx(3.2e9)
    assert hw.fault_latency_s == pytest.approx(45e-6)
    assert hw.route_latency("ssd", "gpu") == pytest.approx(20e-6)
    # SSD traffic shares the PCIe lanes with host traffic (same bus per direction)
    assert hw.route("ssd", "gpu")[0].buses == hw.route("host", "gpu")[0].buses


def test_consumer_gpu_reaches_ssd_through_host():
    hw = load_hardware("rtx4090-24g")
    assert [link.name for link in hw.route("gpu", "ssd")] == ["gpu->host", "host->ssd"]
    assert hw.route_bandwidth("gpu", "ssd") == pytest.approx(5e9)


def test_pmem_read_write_asymmetry():
    hw = load_hardware("cpu-dram-pmem")
    assert hw.route_bandwidth("pmem", "dram") == pytest.approx(39e9)
    assert hw.route_bandwidth("dram", "pmem") == pytest.approx(13e9)


@pytest.mark.parametrize("name", ["g10-a100", "rtx4090-24g", "cpu-dram-pmem"])
def test_toml_round_trip(name):
    hw = load_hardware(name)
    again = hardware_from_toml(hw.to_toml())
    assert again.tiers == hw.tiers and again.links == hw.links and again.buses == hw.buses
    assert math.isclose(again.fault_latency_s, hw.fault_latency_s)
    assert again.move_issue_s == hw.move_issue_s


def test_move_issue_cost_round_trips_and_must_not_be_negative(tmp_path):
    hw = dataclasses.replace(load_hardware("g10-a100"), move_issue_s=15e-6)
    assert math.isclose(hardware_from_toml(hw.to_toml()).move_issue_s, 15e-6)
    path = tmp_path / "bad.toml"
    path.write_text(hw.to_toml().replace("move_issue_us = 15", "move_issue_us = -1"))
    with pytest.raises(HardwareError, match="'move_issue_us' must be a finite number >= 0"):
        load_hardware(path)


def test_runtime_host_costs_round_trip():
    hw = dataclasses.replace(load_hardware("g10-a100"), op_issue_s=12e-6, recompute_issue_s=30e-6,
                             host_step_issue_s=45e-6, async_launch=True, host_copies=True)
    again = hardware_from_toml(hw.to_toml())
    assert math.isclose(again.op_issue_s, 12e-6) and math.isclose(again.recompute_issue_s, 30e-6)
    assert math.isclose(again.host_step_issue_s, 45e-6) and again.async_launch is True
    assert again.host_copies is True


def test_runtime_host_costs_default_to_zero_and_synchronous():
    hw = load_hardware("g10-a100")
    assert (hw.op_issue_s, hw.recompute_issue_s, hw.host_step_issue_s) == (0.0, 0.0, 0.0)
    assert (hw.async_launch, hw.host_copies) == (False, False)
    assert "op_issue_us" not in hw.to_toml() and "async_launch" not in hw.to_toml()


@pytest.mark.parametrize("line, message", [
    ("op_issue_us = -2", "'op_issue_us' must be a finite number >= 0"),
    ("recompute_issue_us = inf", "'recompute_issue_us' must be a finite number >= 0"),
    ("host_step_issue_us = \"1\"", "'host_step_issue_us' must be a number"),
    ("async_launch = 1", "'async_launch' must be true or false"),
    ("host_copies = \"yes\"", "'host_copies' must be true or false"),
])
def test_runtime_host_costs_are_checked(tmp_path, line, message):
    path = tmp_path / "bad.toml"
    text = load_hardware("g10-a100").to_toml()
    path.write_text(text.replace("\n[compute]", f"\n{line}\n\n[compute]", 1))
    with pytest.raises(HardwareError, match=message) as err:
        load_hardware(path)
    assert str(path) in str(err.value)


def test_user_toml_file(tmp_path):
    path = tmp_path / "box.toml"
    path.write_text(load_hardware("g10-a100").to_toml().replace('capacity = 42949672960', 'capacity = "8GiB"'))
    assert load_hardware(path).device_capacity == 8 * 2**30


@pytest.mark.parametrize(
    "change, message",
    [
        (('gbps = 15.754', 'gbps = "fast"'), r"\[\[links\]\] #1: field 'gbps' must be a number"),
        (('device = "gpu"', 'device = "tpu"'), r"field 'device' names 'tpu'"),
        (('capacity = 42949672960', 'capacity = "lots"'), r"\[tiers.gpu\]: field 'capacity'"),
        (('src = "gpu"', 'src = "nvram"'), r"names tier 'nvram'"),
    ],
)
def test_bad_toml_names_the_field(tmp_path, change, message):
    text = load_hardware("g10-a100").to_toml().replace(*change, 1)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(HardwareError, match=message):
        load_hardware(path)


def test_unknown_preset():
    with pytest.raises(HardwareError, match="neither a hardware preset"):
        load_hardware("quantum-9000")


# -- [host_compute]: what the host computes --------------------------------------------


def test_every_preset_has_a_cited_host_optimizer_rate():
    for name in preset_names():
        hc = load_hardware(name).host_compute
        assert hc is not None and math.isfinite(hc.optimizer_bytes_per_s) and hc.optimizer_bytes_per_s > 0, name
        assert "PR #735" in hc.source, name


@pytest.mark.parametrize("name", ["g10-a100", "cpu-dram-pmem"])
def test_host_compute_round_trips_through_toml(name):
    hw = load_hardware(name)
    assert hardware_from_toml(hw.to_toml()).host_compute == hw.host_compute


def test_host_compute_source_with_quotes_round_trips():
    import dataclasses

    from tierflow.hardware import HostCompute

    hw = dataclasses.replace(load_hardware("g10-a100"), host_compute=HostCompute(3.5e9, 'my "box", measured\\today'))
    again = hardware_from_toml(hw.to_toml())
    assert again.host_compute == HostCompute(3.5e9, 'my "box", measured\\today')


def test_host_compute_is_optional():
    text = load_hardware("g10-a100").to_toml()
    bare = text[: text.index("[host_compute]")]
    hw = hardware_from_toml(bare)
    assert hw.host_compute is None and "[host_compute]" not in hw.to_toml()


@pytest.mark.parametrize(
    "section, message",
    [
        ("optimizer_gbps = 0", r"\[host_compute\]: field 'optimizer_gbps' must be a finite number > 0, got 0.0"),
        ("optimizer_gbps = -3", r"field 'optimizer_gbps' must be a finite number > 0"),
        ("optimizer_gbps = inf", r"field 'optimizer_gbps' must be a finite number > 0, got inf"),
        ("optimizer_gbps = nan", r"field 'optimizer_gbps' must be a finite number > 0, got nan"),
        ('optimizer_gbps = "fast"', r"\[host_compute\]: field 'optimizer_gbps' must be a number, got 'fast'"),
        ("source = 'x'", r"\[host_compute\]: missing field 'optimizer_gbps'"),
        ("optimizer_gbps = 5\nsource = 3", r"field 'source' must be a string, got 3"),
        ("optimizer_gpbs = 5", r"\[host_compute\]: unknown field 'optimizer_gpbs'"),
    ],
)
def test_bad_host_compute_names_file_table_and_field(tmp_path, section, message):
    text = load_hardware("g10-a100").to_toml()
    text = text[: text.index("[host_compute]")] + "[host_compute]\n" + section + "\n"
    path = tmp_path / "box.toml"
    path.write_text(text)
    with pytest.raises(HardwareError, match=message) as e:
        load_hardware(path)
    assert str(e.value).startswith(f"{path} [host_compute]:")


def test_host_compute_must_be_a_table():
    text = load_hardware("g10-a100").to_toml()
    text = 'host_compute = 5\n' + text[: text.index("[host_compute]")]
    with pytest.raises(HardwareError, match=r"\[host_compute\]: must be a table"):
        hardware_from_toml(text)


def test_constructed_hardware_checks_host_compute():
    import dataclasses

    from tierflow.hardware import HostCompute

    with pytest.raises(HardwareError, match=r"\[host_compute\]: field 'optimizer_gbps' must be a finite number > 0"):
        dataclasses.replace(load_hardware("g10-a100"), host_compute=HostCompute(float("nan")))


def test_measured_host_optimizer_rate_is_finite_and_positive():
    from tierflow.capture.host import measure_host_optimizer

    hc = measure_host_optimizer((1024, 4096), repeats=1, params_per_size=2, threads=1)
    assert math.isfinite(hc.optimizer_bytes_per_s) and hc.optimizer_bytes_per_s > 0
    assert hc.source.startswith("measured: torch") and "1 threads" in hc.source and "4096 x2" in hc.source


@pytest.mark.parametrize("kwargs", [{"sizes": ()}, {"sizes": (0,)}, {"repeats": 0}, {"params_per_size": 0},
                                    {"threads": 0}])
def test_measure_host_optimizer_rejects_bad_arguments(kwargs):
    from tierflow.capture.host import measure_host_optimizer

    with pytest.raises(HardwareError, match="measure_host_optimizer"):
        measure_host_optimizer(**kwargs)
