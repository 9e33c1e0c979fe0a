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
