"""ElevenLabs' alignment as voxgate attaches it (gateway.compat.alignment), message by message: each segment's
alignment rides on the audio that reaches the segment's end, never on a message of its own."""

from gateway.compat.alignment import AlignmentCarrier, socket_alignment


def test_a_segment_end_known_before_its_audio_arrives_waits_for_that_audio():
    carrier = AlignmentCarrier()
    assert carrier.audio(b"a", 20.0) == []  # held: it may be its segment's last
    assert carrier.audio(b"b", 40.0) == [(b"a", [])]
    # the next segment starts at 60 ms: the audio up to there has not all arrived
    assert carrier.segment_end((0.0, "Hello.", 60.0)) == []
    assert carrier.audio(b"c", 60.0) == [(b"b", [])]
    assert carrier.audio(b"d", 80.0) == [(b"c", [(0.0, "Hello.", 60.0)])]  # the audio that reaches 60 ms
    assert carrier.segment_end((60.0, "Bye.", 80.0)) == [(b"d", [(60.0, "Bye.", 80.0)])]  # held audio covers it
    assert carrier.finish() == []


def test_the_last_audio_carries_every_alignment_left():
    carrier = AlignmentCarrier()
    carrier.audio(b"a", 20.0)
    assert carrier.segment_end((0.0, "One.", 25.0)) == []  # past the audio: a container's bytes lag
    assert carrier.segment_end((25.0, "Two.", 30.0)) == []
    assert carrier.finish() == [(b"a", [(0.0, "One.", 25.0), (25.0, "Two.", 30.0)])]
    assert carrier.finish() == []  # nothing held: a turn without audio sends no alignment


def test_alignment_times_restart_or_run_from_the_context_start():
    spans = [(500.0, "Hi", 560.0), (560.0, "yo", 620.0)]
    relative = socket_alignment(spans, from_context_start=False)
    absolute = socket_alignment(spans, from_context_start=True)
    assert relative["chars"] == absolute["chars"] == ["H", "i", " ", "y", "o", " "]
    assert relative["charStartTimesMs"] == [0, 20, 40, 60, 80, 100]
    assert absolute["charStartTimesMs"] == [500, 520, 540, 560, 580, 600]
    assert relative["charDurationsMs"] == absolute["charDurationsMs"] == [20] * 6
