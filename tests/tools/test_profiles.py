"""The profile sections' bookkeeping on fake profiler events (the sections themselves need a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from tools.gpu_suite.profiles import kernel_timeline


def _event(name, device, start, us, annotation=False):
    span = SimpleNamespace(start=start, elapsed_us=lambda: us)
    return SimpleNamespace(name=name, device_type=device, time_range=span, is_user_annotation=annotation)


def test_kernel_timeline_lists_device_events_in_start_order():
    events = [_event("nvjet_o_proj", DeviceType.CUDA, 30.0, 7.0), _event("cudaGraphLaunch", DeviceType.CPU, 0.0, 1.0),
              _event("_rms_norm_kernel", DeviceType.CUDA, 10.0, 2.5),
              _event("step", DeviceType.CUDA, 5.0, 40.0, annotation=True),  # a record_function range, not a kernel
              _event("nvjet_qkv_a" + "x" * 80, DeviceType.CUDA, 20.0, 10.8)]
    prof = SimpleNamespace(events=lambda: events)
    assert kernel_timeline(prof) == [("_rms_norm_kernel", 2.5), ("nvjet_qkv_a" + "x" * 49, 10.8),
                                     ("nvjet_o_proj", 7.0)]
    assert kernel_timeline(prof, first=1) == [("_rms_norm_kernel", 2.5)]
