"""VITS's FP32 pins (`service.models.mixed_precision` applies them). The list is justified by
`cadenza precision sensitivity`, which serves FP16 sessions with each pin taken out and each
other candidate added and reports the waveform PSNR."""

from __future__ import annotations

from service.models.mixed_precision import pinned_modules, to_mixed_precision

# Module-name patterns (fnmatch) kept in FP32 in the FP16 decoder. The acoustic stage (`enc_p`,
# `dp`) is not among them because it always runs in FP32, whole (durations go through exp() and
# ceil(): one rounding flip moves a frame boundary and shifts all later audio; it is per phoneme,
# so FP32 costs little there). Why each pin:
# - emb_g: speaker embedding lookup (multi-speaker voices), tiny.
# - dec.conv_post: the output conv feeding tanh; its accumulation over 32 channels x 7 taps
#   decides the final sample values.
# `cadenza precision sensitivity` measures each on the served path (bench/RESULTS.md).
VITS_FP32_PINS: tuple[str, ...] = ("emb_g", "dec.conv_post")

# What the sensitivity tool tries: modules the served decoder calls as a whole (a pin works by
# casting at a module's call, and the streaming decoder calls the flow's couplings' parts and the
# generator's layers one stage at a time, never `flow` or `dec` themselves).
VITS_PIN_CANDIDATES: tuple[str, ...] = (
    "emb_g", "flow.flows.*.pre", "flow.flows.*.enc", "flow.flows.*.post", "dec.conv_pre", "dec.cond",
    "dec.ups.*", "dec.resblocks.*", "dec.conv_post",
)

__all__ = ["VITS_FP32_PINS", "VITS_PIN_CANDIDATES", "pinned_modules", "to_mixed_precision"]
