"""Stand-in for torchaudio, which has no build for our torch: the official `voxcpm` package imports it at module
level but only uses it to read prompt WAV files, which the oracle tests never ask it to do."""


def load(*args, **kwargs):
    raise RuntimeError("torchaudio stub: the oracle tests pass audio as tensors, never as files")
