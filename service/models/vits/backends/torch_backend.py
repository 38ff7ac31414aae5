"""PyTorch backend: our VitsModel on CPU or CUDA, FP32 or FP16 with FP32 pins.

On CUDA the batch runs on the engine's stream; each session's guard and
device-to-host copy run on that session's own stream from a bounded pool,
ordered after the batch by an event, so one session's copy never waits for
another's."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kernels.guard import guard
from service.models.compiled import CompiledOrEager
from service.models.cuda_graphs import GraphCapturer, own_stream
from service.models.device_audio import GuardedCopy, guard_async, pinned_copy
from service.models.mixed_precision import no_tf32
from service.models.transfer import to_device
from service.models.vits.backends.base import Capabilities, DevicePriorOut, EncodeOut, HostAudio, VocodeOut
from service.models.vits.model import VitsModel
from service.models.vits.precision import VITS_FP32_PINS, to_mixed_precision
from service.models.vits.receptive_field import decoder_stage_table
from service.models.vits.streaming import VitsStreamingDecoder, stage_shapes
from service.models.vits.voice import Voice

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class TorchBackend:
    name = "torch"

    def __init__(
        self,
        voice: Voice,
        device: str = "cpu",
        threads: int | None = None,
        pins: Sequence[str] = VITS_FP32_PINS,
        compile_acoustic: bool = False,
    ) -> None:
        """`compile_acoustic`: on CUDA, run the acoustic stage's graphs through `torch.compile`
        (see `BatchConfig.compile_acoustic`)."""
        if threads:
            torch.set_num_threads(threads)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU (use --device cpu)")
        self.device = device
        self._device = torch.device(device)
        self.voice = voice
        self.pins = self.fp32_pins = tuple(pins)
        self.models: dict[str, VitsModel] = {"fp32": voice.model.to(self._device).eval()}
        self._encoder_graphs = None
        # The acoustic stage runs on a stream of its own, so it neither waits behind the decoder
        # steps queued on the engine's stream nor holds them up: the device runs both at once.
        self._acoustic_stream = own_stream(self, self._device) if self._device.type == "cuda" else None
        cuda = self._device.type == "cuda"
        # On CUDA, decoder steps are queued on the device and waited for later (see
        # Executor.overlaps), and the acoustic stage's prior stays there (see encode_prior).
        self.capabilities = Capabilities(slot_decoder=True, staged_decoder=True, asynchronous=cuda,
                                         priors_on_device=cuda, acoustic_split=cuda, encoder_graphs=cuda)
        if self._device.type == "cuda":
            model = self.models["fp32"]
            gemm_convs(model.enc_p)
            gemm_convs(model.dp)
            self._encoder_graphs = _EncoderGraphs(model, self._device, compiled=compile_acoustic)
        elif compile_acoustic:
            log.info("compile_acoustic applies to CUDA only: the acoustic stage runs eagerly on %s", device)
        if self._device.type == "cuda":
            no_tf32()  # also done where any voice opens on CUDA; this backend is built directly too
            # The decoder runs a few fixed shapes (its step graphs' buckets), so letting cuDNN
            # time its algorithms once per shape pays for itself; its heuristic choice is slower
            # for the vocoder's FP16 convolutions. (The encoder runs with cuDNN off: see encode.)
            torch.backends.cudnn.benchmark = True

    def supported_precisions(self) -> tuple[str, ...]:
        return ("fp32", "fp16")

    def model_for(self, precision: str) -> VitsModel:
        """The FP32 model, or its FP16 twin with FP32 pins (made on first use)."""
        if precision not in DTYPES:
            raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(DTYPES)}")
        if precision not in self.models:
            self.models[precision] = to_mixed_precision(self.models["fp32"], self.pins, DTYPES[precision])
        return self.models[precision]

    def weight_bytes(self, precision: str) -> int:
        return sum(p.numel() * p.element_size() for p in self.model_for(precision).parameters())

    def _sid(self, sid: np.ndarray | None) -> torch.Tensor | None:
        return None if sid is None else torch.as_tensor(sid, dtype=torch.long, device=self._device)

    def _input(self, x: np.ndarray, precision: str) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(x), device=self._device).to(DTYPES[precision])

    @torch.inference_mode()
    def encode(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None
    ) -> EncodeOut:
        # The acoustic stage is pinned to FP32 as a whole (see precision.py). With TF32 off,
        # cuDNN picks pathologically slow FP32 kernels for the encoder's 192->768 convs at
        # some lengths (H200: 88-127 ms for one conv, 0.5-0.8 s per encoder call, instead of
        # ~1 ms); PyTorch's own kernels take 13-20 ms for the whole stage at every length.
        if self._acoustic_stream is None:
            m_p, logs_p, logw = self._encode(ids, lengths, dp_noise, sid)
            return EncodeOut(m_p.float().numpy(), logs_p.float().numpy(), logw.float().numpy())
        with torch.cuda.stream(self._acoustic_stream):
            m_p, logs_p, logw = self._encode(ids, lengths, dp_noise, sid)
            out = _numpy(torch.cat([m_p, logs_p, logw], dim=1).float())  # one copy back
        c = m_p.shape[1]
        return EncodeOut(out[:, :c], out[:, c : 2 * c], out[:, 2 * c :])

    def encode_prior(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None,
        noise_scale: np.ndarray,
    ) -> DevicePriorOut:
        """`encode` with the prior left on the GPU as (mean, noise_scale x exp(logs_p)), the form
        the decoder's prior memory holds: only the durations come to the host. Moving the prior
        out to the host and back in is host work the engine thread would do per sentence."""
        return self.encode_prior_async(ids, lengths, dp_noise, sid, noise_scale).result()

    @torch.inference_mode()
    def encode_prior_async(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None,
        noise_scale: np.ndarray,
    ) -> PendingPrior:
        """`encode_prior` without waiting for the device: the stage and the durations' copy to
        pinned host memory are queued on the acoustic stream; `.result()` waits for them. So a
        batch cut into length groups is queued whole before the first group is waited for."""
        stream = self._acoustic_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            m_p, logs_p, logw = self._encode(ids, lengths, dp_noise, sid)
            scale = to_device(noise_scale.astype(np.float32), self._device).view(-1, 1, 1)
            prior = torch.stack([m_p.float(), torch.exp(logs_p.float()) * scale], dim=1)
            return PendingPrior(logw.float(), prior)

    def _encode(
        self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray, sid: np.ndarray | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(m_p, logs_p, logw) on the device, queued on the current stream (graph outputs are
        views that the next replay overwrites: use them before)."""
        dev = self._device
        if self._encoder_graphs is not None:
            out = self._encoder_graphs.run(ids, lengths, dp_noise, sid)
            if out is not None:
                return out
        with torch.backends.cudnn.flags(enabled=False):
            m_p, logs_p, logw, _ = self.models["fp32"].encode(
                to_device(ids, dev), to_device(lengths, dev), to_device(dp_noise, dev),
                None if sid is None else to_device(sid.astype(np.int64), dev),
            )
        return m_p, logs_p, logw

    def acoustic_split(self, lengths: Sequence[int]) -> list[int]:
        """How to run an acoustic batch of ascending phoneme `lengths`: group sizes, in order (see
        `_EncoderGraphs.split`); one group where the stage has no graphs (the CPU)."""
        if self._encoder_graphs is None:
            return [len(lengths)]
        return self._encoder_graphs.split(lengths)

    def capture_encoder(self, max_batch: int) -> None:
        """Capture the acoustic stage's CUDA graphs for every batch bucket up to `max_batch`
        and the usual sentence lengths now, so no session waits for a capture."""
        if self._encoder_graphs is not None:
            self._encoder_graphs.capture_all(max_batch)

    @torch.inference_mode()
    def flow(self, z_p: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        model = self.model_for(precision)
        z = self._input(z_p, precision)
        mask = torch.ones(z.shape[0], 1, z.shape[2], device=self._device, dtype=z.dtype)
        return model.flow_reverse(z, mask, self._sid(sid)).float().cpu().numpy()

    def streaming_decoder(
        self, precision: str, capacity: int, max_rows: int = 256, graphs: bool = True,
        graph_frames: Sequence[int] = (),
    ) -> VitsStreamingDecoder:
        """A slot decoder over this backend's model in `precision` (see models/vits/streaming.py);
        on CUDA, steps of `graph_frames` frames and up to `max_rows` rows run as CUDA graphs."""
        buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b < max_rows] + [max_rows]
        return VitsStreamingDecoder(self.model_for(precision), precision, capacity, self._device, DTYPES[precision],
                                    graphs=graphs and self._device.type == "cuda", graph_frames=graph_frames,
                                    buckets=buckets)

    def streaming_lag(self) -> int:
        """Latent frames a slot decoder's audio trails its input."""
        shapes = stage_shapes(self.models["fp32"])
        return sum(s.lead // s.rate for s in shapes)

    @torch.inference_mode()
    def guarded_host(self, audio: torch.Tensor) -> HostAudio:
        """The guard over a whole step's audio [B, S] (one fused kernel on CUDA, which also makes
        the 16-bit PCM), then one copy of each to the host."""
        return self.guard_async(audio).result()

    def guard_async(self, audio: torch.Tensor) -> GuardedCopy:
        """`guarded_host` without waiting (`service.models.device_audio.guard_async`)."""
        return guard_async(audio)

    def decoder_stages(self) -> list[tuple[int, int, int]]:
        return decoder_stage_table(self.models["fp32"])

    @torch.inference_mode()
    def decode_stage(self, index: int, x: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> np.ndarray:
        """One flow coupling or generator stage in FP32 (the staged streaming path)."""
        if precision != "fp32":
            raise ValueError(f"the torch backend's staged decoder runs fp32 only; got {precision!r}")
        model = self.models["fp32"]
        g = model.speaker_embedding(self._sid(sid)) if model.uses_speaker(index) else None
        y = model.decoder_stage(index, self._input(x, "fp32"), g)
        return y.float().cpu().numpy()

    @torch.inference_mode()
    def vocode(self, z: np.ndarray, sid: np.ndarray | None, precision: str = "fp32") -> VocodeOut:
        """Vocode a batch whole (the reference decode), guarded on the host."""
        model = self.model_for(precision)
        return _to_host(model.vocode(self._input(z, precision), self._sid(sid)), precision)


class _EncoderGraphs:
    """The acoustic stage as CUDA graphs, one per (batch bucket, phoneme-length bucket): the
    encoder and the duration predictor are hundreds of small kernels, so launching them costs
    more than running them. Rows and phonemes are padded (masked, as in any batch); padding
    rows get length 1. Longer inputs than `max_phonemes` run eagerly. A padded row costs the
    device as much as a real one, so the row buckets above 8 step by 8 (a batch of 45 runs as
    48 rows, not 64), and `split` cuts a batch of mixed lengths where that is cheaper."""

    BATCHES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128)

    def __init__(self, model: VitsModel, device: torch.device, length_step: int = 32, max_phonemes: int = 512,
                 compiled: bool = False) -> None:
        self.model = model
        # `compiled`: the stage as inductor's fused FP32 kernels, compiled once for every bucket
        # (dynamic shapes) at the first capture's warm-up run; eager if compiling fails.
        self._encode = CompiledOrEager(model.encode, "the acoustic stage", compiled)
        self.device = device
        self.length_step = length_step
        self.max_phonemes = max_phonemes
        self.multi_speaker = model.emb_g is not None
        self.channels = model.hp.inter_channels
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...],
                                                   tuple[torch.Tensor, ...]]] = {}
        self._capturer = GraphCapturer(device)
        self._staged: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], torch.cuda.Event]] = {}
        self.device_ms: dict[tuple[int, int], float] = {}  # per captured bucket, measured by capture_all

    def _bucket(self, batch: int, length: int) -> tuple[int, int] | None:
        rows = next((b for b in self.BATCHES if b >= batch), None)
        padded = -(-length // self.length_step) * self.length_step
        if rows is None or padded > self.max_phonemes:
            return None
        return rows, padded

    def capture_all(self, max_batch: int) -> None:
        """Every bucket a batch of up to `max_batch` sentences can use: a capture while serving
        stalls the engine thread (an eager warm-up run of the stage, then the capture). Each
        graph's device time is measured once captured (`split` plans with it)."""
        for rows in self.BATCHES:
            if rows > max(1, max_batch):
                break
            for length in range(self.length_step, self.max_phonemes + 1, self.length_step):
                graph = self._get(rows, length)[0]
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                self.device_ms[(rows, length)] = start.elapsed_time(end)
        if self.device_ms:
            log.info("acoustic stage: %d CUDA graphs, %.2f-%.2f ms on the device each", len(self.device_ms),
                     min(self.device_ms.values()), max(self.device_ms.values()))

    # Host time a call adds beyond its graph's device time (copies in, replay, the prior and the
    # durations out), in device milliseconds: what one more group costs when `split` weighs it.
    CALL_MS = 0.5

    def split(self, lengths: Sequence[int]) -> list[int]:
        """Group sizes for sentences of ascending phoneme `lengths`, run as consecutive calls:
        the cheapest by the measured device times (padding rows and phonemes costs as much as
        real ones), or one call where nothing was measured."""
        def cost(rows: int, longest: int) -> float | None:
            bucket = self._bucket(rows, longest)
            ms = self.device_ms.get(bucket) if bucket is not None else None
            return None if ms is None else ms + self.CALL_MS

        return split_batch(lengths, cost, self.BATCHES)

    def _get(self, rows: int, length: int) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...],
                                                    tuple[torch.Tensor, ...]]:
        key = (rows, length)
        if key not in self._graphs:
            dev = self.device
            inputs = (torch.zeros(rows, length, dtype=torch.long, device=dev),
                      torch.ones(rows, dtype=torch.long, device=dev),
                      torch.zeros(rows, 2, length, dtype=torch.float32, device=dev),
                      torch.zeros(rows, dtype=torch.long, device=dev))
            with torch.inference_mode(), torch.backends.cudnn.flags(enabled=False):
                graph, outputs = self._encode.retry_eager(lambda: self._capturer.capture(self._run, *inputs, warmups=1))
            self._graphs[key] = (graph, inputs, outputs)
        return self._graphs[key]

    def _staging(self, rows: int, length: int) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event]:
        """Pinned host buffers shaped like bucket (rows, length)'s inputs, and the event after
        their last copy to the device."""
        key = (rows, length)
        if key not in self._staged:
            _, inputs, _ = self._get(rows, length)
            self._staged[key] = (tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in inputs),
                                 torch.cuda.Event())
        return self._staged[key]

    def _run(self, ids: torch.Tensor, lengths: torch.Tensor, noise: torch.Tensor,
             sid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        speaker = sid if self.multi_speaker else None
        m_p, logs_p, logw, _ = self._encode(ids, lengths, noise, speaker)
        return m_p, logs_p, logw

    @torch.inference_mode()
    def run(self, ids: np.ndarray, lengths: np.ndarray, dp_noise: np.ndarray,
            sid: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(m_p, logs_p, logw) as views of the graph's outputs (the next replay overwrites them),
        or None where no graph fits."""
        batch, length = ids.shape
        bucket = self._bucket(batch, length)
        if bucket is None:
            return None
        rows, padded = bucket
        graph, statics, (m_p, logs_p, logw) = self._get(*bucket)
        # Whole padded inputs through this bucket's pinned staging buffers (padding rows: length 1,
        # zeros), one copy each: no pinned allocation per call, and the engine thread, which may
        # wait for the GIL at each call, makes few. A buffer is refilled only once the device has
        # read it.
        staged, copied = self._staging(rows, padded)
        copied.synchronize()
        host_ids, host_len, host_noise, host_sid = (t.numpy() for t in staged)
        host_ids[:] = 0
        host_ids[:batch, :length] = ids
        host_len[:] = 1
        host_len[:batch] = lengths
        host_noise[:] = 0
        host_noise[:batch, :, :length] = dp_noise
        host_sid[:] = 0
        if sid is not None:
            host_sid[:batch] = sid
        for static, host in zip(statics, staged, strict=True):
            static.copy_(host, non_blocking=True)
        copied.record()
        graph.replay()
        return m_p[:batch, :, :length], logs_p[:batch, :, :length], logw[:batch, :, :length]


def _numpy(x: torch.Tensor) -> np.ndarray:
    """A tensor on the host; from a GPU through pinned memory: a copy to pageable memory goes
    through the driver's staging buffers at a fraction of the bus's speed, the engine thread waiting."""
    if x.device.type != "cuda":
        return x.numpy()
    host = pinned_copy(x)
    torch.cuda.current_stream(x.device).synchronize()
    return host.numpy()


def gemm_convs(module: torch.nn.Module) -> None:
    """Run `module`'s 1-D convolutions as one matrix product each (depthwise ones as one
    multiply-and-sum). The acoustic stage runs without cuDNN (see `encode`), and PyTorch's own
    convolution loops over the batch, two kernels per sentence per layer: at 64 sentences most of
    the stage's time is kernel launches. Same arithmetic, so results agree to rounding."""
    for conv in module.modules():
        if isinstance(conv, torch.nn.Conv1d) and conv.stride == (1,) and conv.padding_mode == "zeros" \
                and conv.groups in (1, conv.in_channels) and isinstance(conv.padding, tuple):
            conv.forward = functools.partial(_gemm_conv1d, conv)  # type: ignore[method-assign]


def _gemm_conv1d(conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    (k,), (dilation,) = conv.kernel_size, conv.dilation
    pad = int(conv.padding[0])  # a tuple: `gemm_convs` leaves padding="same" convs alone
    w = conv.weight
    if k == 1 and pad == 0:
        y = torch.matmul(w[:, :, 0], x)  # [O, C] @ [B, C, T]
    else:
        x = F.pad(x, (pad, pad)) if pad else x
        cols = x.unfold(2, dilation * (k - 1) + 1, 1)[..., ::dilation]  # [B, C, T', k]
        if conv.groups == 1:
            b, c, t, _ = cols.shape
            flat = cols.permute(0, 2, 1, 3).reshape(b, t, c * k)  # [B, T', C*k]
            y = torch.matmul(flat, w.reshape(w.shape[0], c * k).t()).transpose(1, 2)
        else:  # depthwise
            y = (cols * w[:, 0].view(1, -1, 1, k)).sum(dim=3)
    if conv.bias is not None:
        y = y + conv.bias.view(1, -1, 1)
    return y


def split_batch(lengths: Sequence[int], cost: Callable[[int, int], float | None], sizes: Sequence[int]) -> list[int]:
    """The cheapest way to run sentences of ascending `lengths` as consecutive groups: their sizes,
    in order. A group of n sentences whose longest has L phonemes costs `cost(n, L)` (None: no
    such call). Group sizes tried: `sizes` and, for the shortest sentences, all of them at once
    (dynamic programming over where the groups end; [len(lengths)] if nothing is priced)."""
    n = len(lengths)
    best = [0.0] + [math.inf] * n
    last = [0] * (n + 1)
    for end in range(1, n + 1):
        for size in {s for s in sizes if s <= end} | {end}:
            c = cost(size, lengths[end - 1])
            if c is not None and best[end - size] + c < best[end]:
                best[end], last[end] = best[end - size] + c, size
    if math.isinf(best[n]):
        return [n] if n else []
    out: list[int] = []
    while n:
        out.append(last[n])
        n -= last[n]
    return out[::-1]


class PendingPrior:
    """The acoustic stage's output on its way to the host (`encode_prior_async`): the
    durations in pinned memory behind one event; the prior stays where it was made."""

    def __init__(self, logw: torch.Tensor, prior: torch.Tensor) -> None:
        self._prior = prior
        self._event: torch.cuda.Event | None = None
        if logw.device.type == "cuda":
            self._logw = pinned_copy(logw)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._logw = logw

    def result(self) -> DevicePriorOut:
        if self._event is not None:
            self._event.synchronize()
        return DevicePriorOut(self._logw.numpy(), self._prior)


def _to_host(audio: torch.Tensor, precision: str) -> VocodeOut:
    """CPU path: the torch reference guard, non-finite samples zeroed."""
    result = guard(audio)
    clean = torch.nan_to_num(audio.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return VocodeOut(audio=clean.cpu().numpy(), nonfinite=result.nonfinite.cpu().numpy().astype(np.int64),
                     precision=precision)
