"""The native servicer's translation of domain events to response messages."""

from __future__ import annotations

from service.api.gen.cadenza.v1 import tts_pb2 as pb
from service.api.native import responses, voice_message
from service.engine.contract import AudioOut, Gender, Precision, VoiceDescription, WordTiming


def test_an_audio_event_becomes_its_words_then_its_chunk() -> None:
    event = AudioOut(audio=b"\x01\x02" * 4410, seq=3, offset_samples=22050, num_samples=4410, sample_rate=22050,
                     utterance=1, precision=Precision.FP16, fallback=True, words=[WordTiming("hello", 22100, 26000)])
    words, audio = responses(event)
    assert words == pb.StreamingSynthesizeResponse(words=pb.WordTimings(words=[
        pb.WordTiming(word="hello", start_sample=22100, end_sample=26000)]))
    assert audio == pb.StreamingSynthesizeResponse(audio=pb.AudioChunk(
        audio=event.audio, seq=3, offset_samples=22050, num_samples=4410, duration_seconds=0.2,
        sample_rate_hz=22050, utterance=1, precision=pb.FP16, fallback=True))
    (plain,) = responses(AudioOut(audio=b"", seq=0, offset_samples=0, num_samples=0, sample_rate=8000,
                                  utterance=-1, precision=Precision.FP32, fallback=False))
    assert plain.WhichOneof("response") == "audio" and plain.audio.precision == pb.FP32


def test_a_voice_lists_its_gender() -> None:
    heart = voice_message(VoiceDescription("kokoro-af_heart", "en-US", 24000, [], False, "kokoro",
                                           gender=Gender.FEMALE))
    assert (heart.name, heart.language, heart.sample_rate_hz, heart.family, heart.gender) == (
        "kokoro-af_heart", "en-US", 24000, "kokoro", pb.FEMALE)
    assert voice_message(VoiceDescription("m", "en-GB", 24000, [], False, gender=Gender.MALE)).gender == pb.MALE
    assert voice_message(VoiceDescription("joe", "en-US", 22050, [], True)).gender == pb.VOICE_GENDER_UNSPECIFIED
