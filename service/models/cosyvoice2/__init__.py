"""CosyVoice2 (FunAudioLLM, Apache-2.0): a Qwen2 LM that writes 25 Hz speech tokens, a
chunk-causal flow-matching decoder from tokens to an 80-band mel, and the HiFT vocoder to 24 kHz.

Our own modules load the official `CosyVoice2-0.5B` directory (`cosyvoice2.yaml`, `llm.pt`,
`flow.pt`, `hift.pt`); the weights come from the user. Built piece by piece, each checked
against the official classes on the same random weights (tests/models/cosyvoice2)."""
