"""Synthetic English speech for speech-recognition tests and benchmarks, and word error rate.

``synthesize`` runs Debian's ``espeak-ng`` (formant synthesis, deterministic, no model files:
``apt-get install -y espeak-ng``; ``make install`` installs it where it can) and resamples its
22.05 kHz WAV to the 16 kHz mono float32 that Whisper expects. ``word_error_rate`` is the
usual corpus WER: word-level edit distance over lowercase words without punctuation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np

INSTALL_HINT = "apt-get install -y espeak-ng"


def synthesize(text: str, path: str | Path | None = None, rate: int = 16000) -> np.ndarray:
    """``text`` spoken by ``espeak-ng`` (default English voice, 175 words per minute) as a
    float32 mono array [samples] at ``rate`` Hz, peak 0.8 or less; also written to ``path``
    as a 16-bit WAV when given. Raises ``RuntimeError`` naming the apt-get command when
    ``espeak-ng`` is not installed."""
    import soundfile
    from scipy.signal import resample_poly

    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise RuntimeError(f"espeak-ng is not installed; install it with: {INSTALL_HINT}")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run([espeak, "-w", str(wav), "--", text], check=True, capture_output=True)
        audio, source_rate = soundfile.read(wav, dtype="float32", always_2d=True)
    ratio = Fraction(rate, source_rate)
    audio = resample_poly(audio.mean(axis=1), ratio.numerator, ratio.denominator)
    audio = (audio * min(1.0, 0.8 / max(float(np.abs(audio).max()), 1e-9))).astype(np.float32)
    if path is not None:
        soundfile.write(path, audio, rate, subtype="PCM_16")
    return audio


def words(text: str) -> list[str]:
    """Lowercase words of ``text`` without punctuation ("Don't stop." -> ["dont", "stop"])."""
    return re.sub(r"[^\w\s]", "", text.lower()).split()


def word_error_rate(references: str | Sequence[str], hypotheses: str | Sequence[str]) -> float:
    """Corpus word error rate: total word-level edit distance (substitutions, insertions,
    deletions) between each reference and its hypothesis over the total number of reference
    words (``words``). One string each or two sequences of equal length."""
    if isinstance(references, str):
        references, hypotheses = [references], [hypotheses]
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references, {len(hypotheses)} hypotheses")
    errors = total = 0
    for reference, hypothesis in zip(references, hypotheses):
        ref, hyp = words(reference), words(hypothesis)
        row = list(range(len(hyp) + 1))  # edit distances of ref[:i] to hyp[:j], row by row
        for i, word in enumerate(ref, 1):
            diagonal, row[0] = row[0], i
            for j, other in enumerate(hyp, 1):
                diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (word != other))
        errors += row[-1]
        total += len(ref)
    return errors / max(total, 1)
