"""AUTO precision: hardware, load and trip history decide, and say why."""

from __future__ import annotations

from service.engine.precision import Hardware, PrecisionPolicy, PrecisionPolicyConfig

GPU = Hardware("cuda", True, "H200 (sm_90)")
OLD_GPU = Hardware("cuda", False, "P100 (sm_60)")
CPU = Hardware("cpu", False, "cpu")


BOTH = ("fp32", "fp16")


def policy(hw: Hardware) -> PrecisionPolicy:
    return PrecisionPolicy(hw, PrecisionPolicyConfig(load_fp16_threshold=10, voice_trip_limit=2, trip_window_s=60.0))


def test_explicit_requests_are_honoured() -> None:
    assert policy(CPU).resolve("fp16", "v", BOTH, 0).precision == "fp16"
    assert policy(GPU).resolve("FP32", "v", BOTH, 0).reason == "requested by the client"


def test_hardware_decides_auto() -> None:
    assert policy(GPU).resolve("auto", "v", BOTH, 0).precision == "fp16"
    decision = policy(CPU).resolve("auto", "v", BOTH, 0)
    assert decision.precision == "fp32" and "no fast FP16" in decision.reason
    decision = policy(GPU).resolve("auto", "v", ("fp32",), 0)
    assert decision.precision == "fp32" and decision.reason == "voice v runs fp32 only"


def test_a_server_loaded_with_int8_runs_auto_in_int8_and_honours_fp32() -> None:
    p, int8 = policy(CPU), ("fp32", "int8")
    decision = p.resolve("auto", "v", int8, 0)
    assert decision.precision == "int8" and "--int8" in decision.reason
    assert p.resolve("fp32", "v", int8, 0).precision == "fp32"
    assert policy(CPU).resolve("auto", "v", ("fp32",), 0).precision == "fp32"


def test_load_pushes_auto_to_fp16() -> None:
    p = policy(OLD_GPU)
    assert p.resolve("auto", "v", BOTH, 9).precision == "fp32"
    decision = p.resolve("auto", "v", BOTH, 10)
    assert decision.precision == "fp16" and "10 live sessions" in decision.reason


def test_a_voice_that_trips_goes_fp32_until_the_window_passes() -> None:
    p = policy(GPU)
    p.record_trip("joe", now=100.0)
    assert p.resolve("auto", "joe", BOTH, 0, now=101.0).precision == "fp16"
    p.record_trip("joe", now=102.0)
    decision = p.resolve("auto", "joe", BOTH, 0, now=103.0)
    assert decision.precision == "fp32" and "tripped" in decision.reason
    assert p.resolve("auto", "other", BOTH, 0, now=103.0).precision == "fp16"
    assert p.resolve("auto", "joe", BOTH, 0, now=200.0).precision == "fp16"
