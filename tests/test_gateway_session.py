"""Sans-I/O pieces of the session: what the listener heard when a turn is cancelled."""

from gateway.turn_report import SegmentAudio, split_heard

TEXTS = ["Hello there.", "How are you today?", "not segmented yet"]
AUDIO = [SegmentAudio("Hello there.", 0, 800), SegmentAudio("How are you today?", 800, 2000)]


def test_nothing_played_means_nothing_heard():
    assert split_heard(TEXTS, AUDIO, 0) == ("", " ".join(TEXTS))


def test_whole_segments_played_are_heard():
    assert split_heard(TEXTS, AUDIO, 800) == ("Hello there.", "How are you today? not segmented yet")
    assert split_heard(TEXTS, AUDIO, 2000) == ("Hello there. How are you today?", "not segmented yet")


def test_a_segment_half_played_is_cut_back_to_a_word_start():
    # 600 of 1200 ms of "How are you today?": half its characters, then back to the start of the word being spoken
    assert split_heard(TEXTS, AUDIO, 1400) == ("Hello there. How are", "you today? not segmented yet")


def test_a_segment_still_being_synthesised_counts_as_unheard():
    audio = [AUDIO[0], SegmentAudio("How are you today?", 800, None)]
    assert split_heard(TEXTS, audio, 1400) == ("Hello there.", "How are you today? not segmented yet")
