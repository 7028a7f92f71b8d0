"""The GPU probe (app/gpu/probe.py): which entry of CUDA_VISIBLE_DEVICES pins a worker to each
device, and the probe process's answer on this machine."""

from __future__ import annotations

from app.gpu.probe import list_gpus, pci_bus_id, probe, visible_ids


def test_visible_ids_follow_the_nodes_own_variable() -> None:
    assert visible_ids(3, None) == ["0", "1", "2"]
    assert visible_ids(2, "") == ["0", "1"]
    assert visible_ids(2, "4,6") == ["4", "6"]
    assert visible_ids(2, "GPU-aaa, GPU-bbb") == ["GPU-aaa", "GPU-bbb"]
    assert visible_ids(2, "3") == ["0", "1"]  # fewer entries than devices seen: plain indices


def test_pci_bus_id_format() -> None:
    assert pci_bus_id({"pciDomainID": 0, "pciBusID": 0x1B, "pciDeviceID": 0}) == "0000:1b:00.0"


async def test_the_probe_process_agrees_with_this_process() -> None:
    found = await probe(60)
    assert [(g.index, g.total_memory_bytes, g.pci_bus_id) for g in found] == [
        (r["index"], r["total_memory_bytes"], r["pci_bus_id"]) for r in list_gpus()
    ]
