"""Shared fixtures for the compatibility tests: one real server per test module and the
native-API reference its audio is compared with."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import riva.client
from google.cloud import texttospeech
from google.cloud.texttospeech_v1.services.text_to_speech.transports import TextToSpeechGrpcTransport

from tests.api.compat_server import Native, running_server


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with running_server() as addr:
        yield addr


@pytest.fixture(scope="module")
def native(address: str) -> Iterator[Native]:
    client = Native(address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tts(address: str) -> riva.client.SpeechSynthesisService:
    return riva.client.SpeechSynthesisService(riva.client.Auth(uri=address, use_ssl=False))


@pytest.fixture(scope="module")
def google(address: str) -> Iterator[texttospeech.TextToSpeechClient]:
    channel = grpc.insecure_channel(address)
    yield texttospeech.TextToSpeechClient(transport=TextToSpeechGrpcTransport(channel=channel))
    channel.close()
