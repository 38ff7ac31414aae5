"""A CosyVoice2 directory (the random-weight test one: the weights say nothing, so no speech
recognition here) through `cadenza serve --voices <its folder>` in a process of its own and the
unmodified Riva and Google clients: the voice lists show it at 24 kHz with its saved speakers,
each API's audio is the native API's for the same seed, speakers are chosen by name, and what the
family cannot do (a speaking rate, a phoneme dictionary) is refused with what to change."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import riva.client
import riva.client.proto.riva_tts_pb2 as rtts
from google.cloud import texttospeech

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.gen.cadenza.v1 import tts_pb2_grpc as pb_grpc
from service.audio.encoding import decode_linear16
from tests.api.compat_server import TIMEOUT_S, Native
from tests.serve_process import start_serve, stop_process

VOICE = "cosyvoice2-test"
TEXT = "Thank you for calling. How can I help you today?"
PROMPT_TEXT = "This is how I sound when I read aloud."
Encoding = texttospeech.AudioEncoding


SERVER_PID: list[int] = []


@pytest.fixture(scope="module")
def address(cosyvoice2_dir: Path) -> Iterator[str]:
    """The server of this module (overrides conftest's, which serves the Piper test voices)."""
    server, port = start_serve("--voices", str(cosyvoice2_dir.parent), "--device", "cpu", "--threads", "2")
    SERVER_PID[:] = [server.pid]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(server)


def test_voice_lists_show_the_directory_with_its_speakers(
    address: str, tts: riva.client.SpeechSynthesisService, google: texttospeech.TextToSpeechClient
) -> None:
    with grpc.insecure_channel(address) as channel:
        info = pb_grpc.TextToSpeechStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT_S)
    voice = {v.name: v for v in info.voices}[VOICE]
    assert (voice.family, voice.sample_rate_hz, voice.language) == ("cosyvoice2", 24000, "en-US")
    assert [(s.id, s.name) for s in voice.speakers] == [(0, "prompt_a"), (1, "sft_b")]
    config = tts.stub.GetRivaSynthesisConfig(rtts.RivaSynthesisConfigRequest(), timeout=TIMEOUT_S)
    assert {m.model_name: m.parameters for m in config.model_config}[VOICE]["sample_rate"] == "24000"
    assert f"en-US-Cadenza-{VOICE}" in {v.name for v in google.list_voices(timeout=TIMEOUT_S).voices}


def test_riva_and_google_give_the_native_audio(tts: riva.client.SpeechSynthesisService,
                                               google: texttospeech.TextToSpeechClient, native: Native) -> None:
    want = native.synthesize(TEXT, voice=VOICE)
    assert 1.0 < len(decode_linear16(want)) / 24000 < 30.0
    assert tts.synthesize(TEXT, voice_name=VOICE, language_code="en-US", sample_rate_hz=24000).audio == want
    online = b"".join(r.audio for r in tts.synthesize_online(TEXT, voice_name=VOICE, sample_rate_hz=24000))
    assert online == want
    response = google.synthesize_speech(
        input=texttospeech.SynthesisInput(text=TEXT),
        voice=texttospeech.VoiceSelectionParams(language_code="en-US", name=f"en-US-Cadenza-{VOICE}"),
        audio_config=texttospeech.AudioConfig(audio_encoding=Encoding.PCM), timeout=TIMEOUT_S)
    assert response.audio_content == want


def test_a_speaker_is_chosen_by_name(native: Native) -> None:
    first = native.synthesize(TEXT, voice=VOICE)
    assert native.synthesize(TEXT, voice=VOICE, speaker="prompt_a") == first
    assert native.synthesize(TEXT, voice=VOICE, speaker="sft_b") != first
    with pytest.raises(grpc.RpcError) as caught:
        native.synthesize(TEXT, voice=VOICE, speaker="nobody")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "prompt_a, sft_b" in str(caught.value.details())


@pytest.mark.parametrize(("config", "field", "advice"), [
    ({"speaking_rate": 1.5}, "speaking_rate", "leave speaking_rate at 1.0"),
    ({"custom_dictionary": {"hello": "h@loU"}}, "custom_dictionary", "send no custom dictionary"),
])
def test_what_the_family_cannot_do_is_refused_with_what_to_change(native: Native, config: dict[str, object],
                                                                    field: str, advice: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        native.synthesize(TEXT, voice=VOICE, **config)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in str(caught.value.details()) and advice in str(caught.value.details())


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A speaker's recording as a client would send it: a 22.05 kHz 16-bit WAV, 2.5 s."""
    from tests.models.cosyvoice2.test_prompt import voiced, wav_bytes

    path = tmp_path_factory.mktemp("prompt") / "speaker.wav"
    path.write_bytes(wav_bytes(voiced(2.5, 22_050), 22_050))
    return path


def test_a_voice_prompt_is_spoken_alike_through_riva_and_native(
        tts: riva.client.SpeechSynthesisService, native: Native, recording: Path) -> None:
    prompt = pb.VoicePrompt(audio=recording.read_bytes(), transcript=PROMPT_TEXT)
    want = native.synthesize(TEXT, voice=VOICE, voice_prompt=prompt)
    assert want != native.synthesize(TEXT, voice=VOICE) and len(decode_linear16(want)) > 24000
    assert native.synthesize(TEXT, voice=VOICE, voice_prompt=prompt) == want  # seeded: the same again
    got = tts.synthesize(TEXT, voice_name=VOICE, language_code="en-US", sample_rate_hz=24000,
                         zero_shot_audio_prompt_file=recording, zero_shot_transcript=PROMPT_TEXT)
    assert got.audio == want
    # Riva's streaming call sends no transcript: only the recording's sound is imitated (cross-lingual)
    sound_only = native.synthesize(TEXT, voice=VOICE, voice_prompt=pb.VoicePrompt(audio=recording.read_bytes()))
    assert sound_only not in (want, native.synthesize(TEXT, voice=VOICE))
    online = tts.synthesize_online(TEXT, voice_name=VOICE, sample_rate_hz=24000, zero_shot_audio_prompt_file=recording)
    assert b"".join(r.audio for r in online) == sound_only
    voices = {v.name: v for v in native.stub.ListVoices(pb.ListVoicesRequest(), timeout=TIMEOUT_S).voices}
    assert voices[VOICE].voice_prompts and not voices["en_US-joe-medium"].voice_prompts
    # the prompts were made in the API process, which still has not loaded torch (its core has)
    assert "libtorch" not in Path(f"/proc/{SERVER_PID[0]}/maps").read_text()


def test_a_voice_prompt_as_raw_pcm_with_its_rate_is_the_wav_it_came_from(native: Native, recording: Path,
                                                                          tts: riva.client.SpeechSynthesisService
                                                                          ) -> None:
    from service.audio.wav import read_wav

    samples, rate = read_wav(recording.read_bytes())
    request = rtts.SynthesizeSpeechRequest(text=TEXT, voice_name=VOICE, sample_rate_hz=24000, language_code="en-US")
    request.zero_shot_data.audio_prompt = recording.read_bytes()[44:]  # the samples without the header
    request.zero_shot_data.encoding = riva.client.AudioEncoding.LINEAR_PCM
    request.zero_shot_data.sample_rate_hz = rate
    request.zero_shot_data.transcript = PROMPT_TEXT
    prompt = pb.VoicePrompt(audio=recording.read_bytes(), transcript=PROMPT_TEXT)
    assert tts.stub.Synthesize(request, timeout=TIMEOUT_S).audio == native.synthesize(TEXT, voice=VOICE,
                                                                                      voice_prompt=prompt)
    assert len(samples) == 2.5 * 22_050


@pytest.mark.parametrize(("change", "field", "advice"), [
    ({"audio": b"ID3 an mp3"}, "zero_shot_data", "send a WAV recording, or raw LINEAR_PCM"),
    ({"audio": b""}, "zero_shot_data.audio_prompt", "is empty"),
    ({"short": True}, "zero_shot_data", "use 0.5 to 30 s of the speaker"),
    ({"voice": "en_US-joe-medium"}, "zero_shot_data", "has fixed speakers and takes no voice prompt; voices that "
                                                      f"do: {VOICE}"),
    ({"speaker": True}, "zero_shot_data", "give a speaker or a voice prompt, not both"),
])
def test_a_bad_voice_prompt_is_refused_with_what_to_change(tts: riva.client.SpeechSynthesisService, native: Native,
                                                           recording: Path, change: dict[str, object], field: str,
                                                           advice: str) -> None:
    from tests.models.cosyvoice2.test_prompt import voiced, wav_bytes

    request = rtts.SynthesizeSpeechRequest(text=TEXT, voice_name=str(change.get("voice", VOICE)),
                                           sample_rate_hz=24000, language_code="en-US")
    if change.get("speaker"):
        request.voice_name = f"{VOICE}.sft_b"
    audio = change.get("audio", recording.read_bytes())
    request.zero_shot_data.audio_prompt = wav_bytes(voiced(0.2, 16_000), 16_000) if change.get("short") else audio
    with pytest.raises(grpc.RpcError) as caught:
        tts.stub.Synthesize(request, timeout=TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = str(caught.value.details())
    assert field in details and advice in details and "Traceback" not in details
    assert native.synthesize(TEXT, voice=VOICE)  # the server goes on
