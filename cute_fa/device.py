"""Facts about a CUDA device that planning needs, read once per device and process."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import tuned
from .cache import driver_cuda_version, dsl_version, package_version


class DeviceFacts(NamedTuple):
    capability: tuple[int, int]
    sm_count: int  # the CTAs of a persistent grid
    name: str


_device_facts: dict[int, DeviceFacts] = {}


def facts(device: torch.device) -> DeviceFacts:
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _device_facts.get(index)
    if found is None:
        props = torch.cuda.get_device_properties(index)
        found = _device_facts[index] = DeviceFacts(
            (props.major, props.minor), props.multi_processor_count, props.name
        )
    return found


def capability(device: torch.device) -> tuple[int, int]:
    return facts(device).capability


def sm_count(device: torch.device) -> int:
    """SMs of the device (the CTAs of a persistent grid)."""
    return facts(device).sm_count


_table_keys: dict[str, tuned.TableKey] = {}


def table_key(device: torch.device) -> tuned.TableKey:
    """What a tuned table for this device must have been measured on (read once per device:
    the versions come from package metadata)."""
    f = facts(device)
    key = _table_keys.get(f.name + str(f.sm_count))
    if key is None:
        key = _table_keys[f.name + str(f.sm_count)] = tuned.TableKey(
            gpu=f.name,
            sm_count=f.sm_count,
            driver=driver_cuda_version() or 0,
            dsl=dsl_version() or "unknown",
            cute_fa=package_version(),
        )
    return key


def tuned_table(device: torch.device) -> tuned.Table | None:
    """The device's tuned table (``cute_fa/tuned.py``), or None."""
    return tuned.load_table(table_key(device))
