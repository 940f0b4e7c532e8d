"""``python -m benchmarks.whisper``: Whisper tiny.en word error rate vs eps with DP cross-attention.

Twelve fixed English sentences (``SENTENCES``) are spoken by ``espeak-ng``
(``models.speech.synthesize``, 16 kHz, written as 16-bit WAV files) and transcribed greedily
(temperature 0, at most ``MAX_TOKENS`` tokens) by Whisper tiny.en (``vllm-dp import-model
whisper-tiny-en``), one request at a time. Score: corpus word error rate
(``models.speech.word_error_rate``: word-level edits over reference words, lowercase, no
punctuation); it can exceed 1 when a transcription inserts many words.

Rows (``ROWS``):

* ``stock``: stock vLLM (``VLLM_PLUGINS=``), the ``LLM`` API in a subprocess with the decoder
  prompt ``<|startoftranscript|><|notimestamps|>`` that tiny.en was trained with, on the audio
  the server rows receive (decoded from the same WAV bytes by vLLM's own ``load_audio``). Stock
  ``vllm serve`` cannot transcribe tiny.en (next row), so this is stock vLLM's transcription;
* ``stock_server``: stock ``vllm serve`` and ``POST /v1/audio/transcriptions``: vLLM prompts every
  Whisper with ``<|en|><|transcribe|>``, which English-only checkpoints never saw (the plugin drops
  them: ``serving.whisper``);
* ``dp_off``: ``vllm-dp serve`` (the plugin loaded) without ``dp_privacy.attention``, the same
  endpoint: must equal ``stock`` exactly (``dp_off_equals_stock`` in the result);
* ``dp_state`` / ``dp_tree``: ``vllm-dp serve`` with DP cross-attention (``--modes``): each
  request's encoder output (1500 rows) is its private context, released once per request and
  layer, and every decoder cross-attention query reads only the release. At each eps of
  ``--eps`` (eps for the whole model per request, delta = ``DELTA``; PLD composition up to eps =
  100, ``basic`` beyond, as PLD refuses it) and eps = 1e7, where the noise is negligible and the
  kernel (feature map) error is what remains. A DP row's privacy statement (``GET
  /v1/dp/budget``) is kept in the result. A mode whose release cannot be built (the DPTree's
  table for 1500 rows at the planned Taylor degree is far above its memory cap) is reported as
  refused, with the reason, instead of failing the run.

Public bounds (``--calibration``): ``speech`` (default) runs the model in transformers over
``CALIBRATION_SENTENCES`` (other sentences than the benchmark's, also spoken by espeak-ng, public)
with their transcripts as decoder input (``calibration.calibrate``, clipping quantile
``--quantile``); ``synthetic`` is ``vllm-dp calibrate`` (a sine sweep and white noise, pydoc tokens
as decoder input); or a calibration file. Calibrations are cached in ``--cache-dir`` by weights
digest and settings.

One server per row (and eps), its KV cache sized in bytes (``serving.memory``); the noise key and the release
ledger live in a temporary directory of the run. A server (or the stock run) that dies while
starting, e.g. killed for memory on a shared host, is retried twice. A public warm-up request (a
calibration sentence) precedes each row's timed requests. Writes
``whisper-<device>-<date>.{md,json,png}`` into ``--out``; exits 1 when ``dp_off`` differs from
``stock``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import with_example
from vllm_dp_plugin.benchmarks.lib import vllm as vllm_lib
from vllm_dp_plugin.benchmarks.lib.cli import DEFAULT_OUT, command_line, floats, names, parse, today
from vllm_dp_plugin.benchmarks.lib.environment import default_device, device_label, loadavg
from vllm_dp_plugin.benchmarks.lib.report import (
    fmt,
    pyplot,
    read_json,
    save_figure,
    suffixed,
    table,
    write_json,
    write_text,
)
from vllm_dp_plugin.benchmarks.lib.vllm import LAUNCH, VLLM_DP
from vllm_dp_plugin.serving.memory import kv_cache_args, kv_cache_flags

DEFAULT_MODEL = ".models/whisper-tiny-en"
DEFAULT_MODEL_NAME = "whisper-tiny-en"  # built with vllm_dp_plugin.models.import_model when missing
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-dp" / "bench-whisper"
DEFAULT_EPS = (8.0, 64.0, 1000.0)
KERNEL_ONLY_EPS = 1e7  # noise negligible: what remains is the kernel (feature map) error
MAX_CURVE_EPS = 100.0  # pld accounting refuses larger eps (config.MAX_CURVE_EPSILON)
DELTA = 1e-6
MAX_TOKENS = 64
SAMPLE_RATE = 16_000
DEFAULT_QUANTILE = 0.999
DECODER_PROMPT = "<|startoftranscript|><|notimestamps|>"  # what tiny.en was trained with
SAMPLES = 3  # sample transcriptions per row in the report
START_ATTEMPTS, RETRY_WAIT_S = 3, 60.0  # a server (or the stock run) that dies while starting is retried
MODES = ("state", "tree")
BASE_ROWS = ("stock", "stock_server", "dp_off")
ROWS = {
    "stock": "stock vLLM (VLLM_PLUGINS=), LLM API, decoder prompt <|startoftranscript|><|notimestamps|>",
    "stock_server": "stock vllm serve (VLLM_PLUGINS=), POST /v1/audio/transcriptions",
    "dp_off": "vllm-dp serve, plugin loaded, no dp_privacy.attention, POST /v1/audio/transcriptions",
    "dp_state": "vllm-dp serve, DP cross-attention mode state (noisy kernelised state), per-request encoder output private",
    "dp_tree": "vllm-dp serve, DP cross-attention mode tree (DPTree), per-request encoder output private",
}
# Whisper's serving flags (tests/serving/test_dp_whisper.py): float32, eager, 448-token decoder;
# the KV cache in bytes (serving.memory) is added per model by serve_flags / llm_args.
MAX_MODEL_LEN = 448
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "2048",
               "--block-size", "32", "--enforce-eager", "--limit-mm-per-prompt", '{"audio": 1}', "--seed", "0"]
LLM_ARGS = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 2048, "block_size": 32,
            "enforce_eager": True, "limit_mm_per_prompt": {"audio": 1}, "seed": 0}


def serve_flags(model: str) -> list[str]:
    return [*SERVE_FLAGS, *kv_cache_flags(model, MAX_MODEL_LEN)]

# The test audio: fixed sentences, deterministic (espeak-ng is).
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please send the report to the finance team before Friday.",
    "The weather today is cold and windy with a chance of rain.",
    "My doctor told me to drink more water and sleep eight hours a night.",
    "The new bridge will open to traffic at the end of next month.",
    "We need three eggs, a cup of flour and some milk for the pancakes.",
    "The concert was cancelled because the singer had lost her voice.",
    "Turn left at the second traffic light and park behind the bank.",
    "Scientists have found water ice in a crater near the south pole of the moon.",
    "The password for the wireless network is written on the back of the router.",
    "He paid four hundred dollars for a used bicycle and a new helmet.",
    "Our flight to Boston was delayed by two hours because of a storm.",
)
# Public calibration audio: other sentences (no benchmark sentence, checked by the tests).
CALIBRATION_SENTENCES = (
    "A public library lends books, music and films to anyone with a card.",
    "The train to the coast leaves from platform four every hour.",
    "Fresh bread is baked each morning in the small shop on the corner.",
    "Children played football in the park until the sun went down.",
    "The museum opens at nine and closes at five on weekdays.",
    "She planted tomatoes, beans and lettuce in her garden last spring.",
    "Our meeting has been moved to the large room on the second floor.",
    "The river rose quickly after three days of heavy rain.",
    "Remember to switch off the lights when you leave the office.",
    "A cup of hot tea is the best thing on a winter afternoon.",
    "The old castle on the hill is now a hotel with forty rooms.",
    "Students must hand in their essays by the end of the week.",
)
WARMUP_SENTENCE = CALIBRATION_SENTENCES[0]  # public: the warm-up request of every row


# =========================================================================== jobs
@dataclass(frozen=True)
class Job:
    """One measured row: ``row`` (a ``ROWS`` key) at ``eps`` (DP rows only)."""

    row: str
    eps: float | None = None

    @property
    def mode(self) -> str | None:
        """The DP attention mode of a DP row, else None."""
        return self.row.removeprefix("dp_") if self.row in ("dp_state", "dp_tree") else None

    @property
    def label(self) -> str:
        return self.row if self.eps is None else f"{self.row} eps={self.eps:g}"


def composition(eps: float) -> str:
    """PLD up to ``MAX_CURVE_EPS`` (where it is tightest), ``basic`` beyond (PLD refuses)."""
    return "pld" if eps <= MAX_CURVE_EPS else "basic"


def jobs_of(rows: Sequence[str], modes: Sequence[str], eps: Sequence[float]) -> list[Job]:
    """The rows to measure, in order: ``rows`` (of ``BASE_ROWS``) once each, then each mode of
    ``modes`` at every eps of ``eps`` (eps = ``KERNEL_ONLY_EPS`` appended when missing)."""
    for row in rows:
        if row not in BASE_ROWS:
            raise SystemExit(f"python -m benchmarks.whisper: unknown row {row!r}; rows are {', '.join(BASE_ROWS)}")
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"python -m benchmarks.whisper: unknown mode {mode!r}; modes are {', '.join(MODES)}")
    eps = list(dict.fromkeys(float(e) for e in eps))
    if modes and KERNEL_ONLY_EPS not in eps:
        eps.append(KERNEL_ONLY_EPS)
    for e in eps:
        if not (e > 0 and math.isfinite(e)):
            raise SystemExit(f"python -m benchmarks.whisper: eps must be positive and finite, got {e!r}")
    return [Job(r) for r in dict.fromkeys(rows)] + [Job(f"dp_{m}", e) for m in dict.fromkeys(modes) for e in eps]


def attention_section(mode: str, eps: float, calibration: Path | str, extra: dict | None = None) -> dict:
    """The ``dp_privacy.attention`` section of a DP row (``extra``: more attention keys)."""
    return {"mode": mode, "epsilon": eps, "delta": DELTA, "composition": composition(eps),
            "calibration": str(calibration), **(extra or {})}


def dp_config(work: Path, attention: dict | None) -> dict:
    """A ``dp_privacy`` section with the run's own key file and release ledger (never the
    operator's ``~/.config``); ``attention`` None: the plugin loaded, DP attention off."""
    section = {"key_file": str(work / "noise.key"), "ledger": str(work / "ledger.sqlite")}
    if attention is not None:
        section["attention"] = attention
    return {"dp_privacy": section}


def tree_refusal(model: str, attention: dict) -> str | None:
    """Why the DPTree release of one request's encoder output cannot be built (its fp32 path-sum
    table above ``memory_limit_bytes``: ``ContextPlan.memory_refusal``, with which the server
    refuses the same configuration at start-up), or None; checked here so that a refused row
    costs no server start. Public: the plan of the configuration and the model's shape only."""
    from vllm_dp_plugin.config import AttentionPrivacyConfig
    from vllm_dp_plugin.plan import ContextPlan, ModelShape

    shape = ModelShape.from_pretrained(model)
    plan = ContextPlan.of(AttentionPrivacyConfig(**attention), shape, "cross_attention", shape.encoder_positions)
    return plan.memory_refusal()


# =========================================================================== scoring
def sentence_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(word edits, reference words) of one transcription."""
    from vllm_dp_plugin.models.speech import word_error_rate, words

    n = len(words(reference))
    return round(word_error_rate(reference, hypothesis) * max(n, 1)), n


def score(references: Sequence[str], hypotheses: Sequence[str]) -> dict:
    """Corpus WER (``word_error_rate``) with its edit and word counts and each sentence's WER."""
    from vllm_dp_plugin.models.speech import word_error_rate

    counts = [sentence_errors(r, h) for r, h in zip(references, hypotheses, strict=True)]
    return {"wer": word_error_rate(list(references), list(hypotheses)),
            "errors": sum(e for e, _ in counts), "words": sum(n for _, n in counts),
            "sentence_wer": [e / max(n, 1) for e, n in counts]}


def budget_summary(report: dict) -> dict:
    """The privacy statement of a DP row: its ``/v1/dp/budget`` context report, condensed."""
    keys = ("mode", "context", "unit", "composition", "releases", "per_release", "spent", "budget",
            "noise_std", "logit_bound", "taylor_degree", "kernel_error", "regime", "context_tokens")
    return {k: report.get(k) for k in keys if k in report}


def summarize(job: Job, references: Sequence[str], texts: Sequence[str], seconds: Sequence[float],
              budget: dict | None = None) -> dict:
    """One result row: corpus WER, mean seconds per request, every transcription."""
    return {"row": job.row, "mode": job.mode, "eps": job.eps,
            "composition": None if job.eps is None else composition(job.eps),
            **score(references, texts), "seconds_per_request": sum(seconds) / max(len(seconds), 1),
            "n": len(texts), "empty": sum(not t.strip() for t in texts), "texts": list(texts), "seconds": list(seconds),
            **({"budget": budget_summary(budget)} if budget else {})}


def refused(job: Job, reason: str) -> dict:
    """A row whose mode could not serve (reason kept): no WER."""
    return {"row": job.row, "mode": job.mode, "eps": job.eps,
            "composition": None if job.eps is None else composition(job.eps), "refused": reason}


def same_transcriptions(a: dict | None, b: dict | None) -> dict | None:
    """Whether two rows transcribed every sentence identically (None when one is missing):
    ``{"equal": bool, "differ": [sentence indices]}``."""
    if not a or not b or "texts" not in a or "texts" not in b:
        return None
    differ = [i for i, (x, y) in enumerate(zip(a["texts"], b["texts"], strict=True)) if x.strip() != y.strip()]
    return {"equal": not differ, "differ": differ}


# =========================================================================== audio
def wav_bytes(text: str) -> bytes:
    """``text`` spoken by espeak-ng as a 16 kHz 16-bit mono WAV file (what the requests send)."""
    from vllm_dp_plugin.models.speech import synthesize

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        synthesize(text, path, SAMPLE_RATE)
        return path.read_bytes()


def write_clips(texts: Sequence[str], where: Path) -> list[Path]:
    """One WAV file per text under ``where`` (``00.wav``, ...)."""
    where.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(texts):
        path = where / f"{i:02d}.wav"
        path.write_bytes(wav_bytes(text))
        paths.append(path)
    return paths


# =========================================================================== calibration
def speech_calibration(model: str, out: Path, sentences: Sequence[str] = CALIBRATION_SENTENCES,
                       quantile: float = DEFAULT_QUANTILE) -> Path:
    """Calibrate ``model`` on public espeak-ng speech: each sentence's log-mel features as
    encoder input and its transcript (``<|startoftranscript|><|notimestamps|> text<|endoftext|>``)
    as decoder input, one unpadded batch per sentence (``calibration.calibrate``); writes ``out``."""
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from vllm_dp_plugin.calibration import calibrate
    from vllm_dp_plugin.models.speech import synthesize

    extractor = WhisperFeatureExtractor.from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    batches = []
    for text in sentences:
        features = extractor([synthesize(text, rate=SAMPLE_RATE)], sampling_rate=SAMPLE_RATE,
                             return_tensors="pt")["input_features"]
        ids = torch.tensor([tokenizer.encode(" " + text)])  # the tokenizer adds the prompt and <|endoftext|>
        batches.append({"input_features": features, "decoder_input_ids": ids})
    weights = WhisperForConditionalGeneration.from_pretrained(model, dtype=torch.float32)
    result = calibrate(weights, batches, quantile=quantile, model_name=str(model),
                       source=f"espeak-ng speech of {len(sentences)} public sentences (python -m benchmarks.whisper)")
    out.parent.mkdir(parents=True, exist_ok=True)
    result.to_file(out)
    return out


def calibration_file(model: str, kind: str, quantile: float, cache_dir: Path) -> Path:
    """The public calibration of ``kind`` (``speech``, ``synthetic`` or an existing file), made
    once and cached in ``cache_dir`` by weights digest, kind, quantile and sentences."""
    if kind not in ("speech", "synthetic"):
        path = Path(kind)
        if not path.is_file():
            raise SystemExit(f"python -m benchmarks.whisper: --calibration {kind!r} is neither speech, synthetic nor a file")
        return path
    from vllm_dp_plugin.serving.context import weights_digest

    settings = json.dumps([kind, quantile, CALIBRATION_SENTENCES if kind == "speech" else None]).encode()
    tag = f"{weights_digest(model)[:12]}-{hashlib.sha256(settings).hexdigest()[:8]}"
    path = cache_dir / f"calibration-{Path(model).name}-{kind}-q{quantile:g}-{tag}.json"
    if path.exists():
        return path
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    if kind == "speech":
        speech_calibration(model, tmp, quantile=quantile)
    else:
        from vllm_dp_plugin.calibration import calibrate_model

        tmp.parent.mkdir(parents=True, exist_ok=True)
        calibrate_model(model, tmp, quantile=quantile)
    tmp.replace(path)
    return path


# =========================================================================== serving
class Server(vllm_lib.RunningServer):
    """A Whisper server (``benchmarks.lib.vllm.RunningServer``) asked for transcriptions."""

    def transcribe(self, model: str, wav: bytes, max_tokens: int = MAX_TOKENS) -> str:
        """``POST /v1/audio/transcriptions``: greedy, English, at most ``max_tokens`` tokens."""
        import requests

        reply = requests.post(
            self.base + "/v1/audio/transcriptions",
            files={"file": ("speech.wav", wav, "audio/wav")},
            data={"model": model, "language": "en", "temperature": "0",
                  "max_completion_tokens": str(max_tokens)},
            timeout=900,
        )
        if reply.status_code != 200:
            raise RuntimeError(f"/v1/audio/transcriptions answered {reply.status_code}: {reply.text[:2000]}")
        return reply.json()["text"]


def server_command(model: str, job: Job, work: Path, attention: dict | None) -> tuple[list[str], dict]:
    """(command, environment) of a server row: stock ``vllm serve`` (no plugins) or ``vllm-dp
    serve`` with the row's ``--dp-config`` (``attention`` None: DP attention off)."""
    if job.row == "stock_server":
        return [*LAUNCH, "serve", model, *serve_flags(model)], vllm_lib.with_env({"VLLM_PLUGINS": ""})
    config = work / f"dp-{job.label.replace(' eps=', '-eps')}.json"
    config.write_text(json.dumps(dp_config(work, attention), indent=1))
    return ([*VLLM_DP, "serve", model, "--dp-config", str(config), *serve_flags(model)],
            vllm_lib.with_env({"VLLM_PLUGINS": None}))


def served(model: str, job: Job, clips: Sequence[Path], warmup: Path, work: Path, attention: dict | None,
           bar=None) -> tuple[list[str], list[float], dict | None]:
    """Transcribe ``clips`` one at a time through a server of ``job`` after one untimed
    ``warmup`` request: (texts, seconds per request, the DP budget statement or None)."""
    cmd, env = server_command(model, job, work, attention)
    log = work / f"server-{job.label.replace(' eps=', '-eps')}.log"
    server = retried(lambda: Server(cmd, log, env, timeout=900).__enter__(), f"{job.label}: server start")
    try:
        budget = server.get("/v1/dp/budget")["contexts"][0] if attention is not None else None
        server.transcribe(model, warmup.read_bytes())
        texts, seconds = [], []
        for clip in clips:
            wav = clip.read_bytes()
            start = time.perf_counter()
            texts.append(server.transcribe(model, wav))
            seconds.append(time.perf_counter() - start)
            if bar is not None:
                bar.update(1)
    finally:
        server.stop()
    return texts, seconds, budget


def retried(start, what: str, attempts: int = START_ATTEMPTS, wait: float = RETRY_WAIT_S, log=None):
    """``start()``, tried up to ``attempts`` times ``wait`` seconds apart while it raises
    RuntimeError (an engine killed while starting, e.g. by the out-of-memory killer on a shared
    host); the last error is raised."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except RuntimeError as exc:
            if attempt == attempts:
                raise
            log(f"python -m benchmarks.whisper: {what} failed (attempt {attempt} of {attempts}), retrying in "
                f"{wait:.0f} s: {_last_lines(str(exc), 2)}")
            time.sleep(wait)
    raise AssertionError("unreachable")


def stock_llm(model: str, clips: Sequence[Path], warmup: Path, work: Path) -> tuple[list[str], list[float]]:
    """Stock vLLM's ``LLM`` API in a subprocess (``VLLM_PLUGINS=``): (texts, seconds per
    request), one request at a time after a warm-up (``stock_worker``)."""
    job = work / "stock-job.json"
    result = work / "stock-result.json"
    job.write_text(json.dumps({"model": model, "clips": [str(c) for c in clips], "warmup": str(warmup),
                               "out": str(result), "max_tokens": MAX_TOKENS}))
    cmd = [sys.executable, "-m", "benchmarks.whisper", "--stock-worker", str(job)]
    retried(lambda: vllm_lib.run_logged(cmd, vllm_lib.with_env({"VLLM_PLUGINS": ""}), work / "stock.log",
                                        timeout=1800), "stock: LLM run")
    data = json.loads(result.read_text())
    return data["texts"], data["seconds"]


def stock_worker(job_path: str) -> int:
    """The ``stock`` row's process: stock vLLM (``VLLM_PLUGINS`` empty), explicit encoder/decoder
    prompts, the audio decoded from the WAV bytes by vLLM's ``load_audio`` exactly as the
    transcription endpoint decodes it, sampling as the endpoint builds it (the model's defaults,
    temperature 0, ``max_tokens``)."""
    from vllm_dp_plugin.serving.vllm_compat import install_version_shim

    install_version_shim()
    from vllm import LLM
    from vllm.multimodal.media.audio import load_audio

    job = json.loads(Path(job_path).read_text())
    llm = LLM(model=job["model"], **LLM_ARGS, **kv_cache_args(job["model"], MAX_MODEL_LEN))
    params = llm.get_default_sampling_params()
    params.temperature, params.max_tokens = 0.0, job["max_tokens"]

    def prompt(path: str) -> dict:
        with io.BytesIO(Path(path).read_bytes()) as buf:
            audio, rate = load_audio(buf, sr=SAMPLE_RATE, mono=True)
        return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (audio, rate)}},
                "decoder_prompt": DECODER_PROMPT}

    llm.generate([prompt(job["warmup"])], params, use_tqdm=False)
    texts, seconds = [], []
    for clip in job["clips"]:
        request = prompt(clip)
        start = time.perf_counter()
        out = llm.generate([request], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        texts.append(out[0].outputs[0].text)
    Path(job["out"]).write_text(json.dumps({"texts": texts, "seconds": seconds}))
    return 0


def run(model: str, jobs: Sequence[Job], references: Sequence[str], clips: Sequence[Path], warmup: Path,
        work: Path, calibration: Path | None, extra: dict | None, after_row=None, log=None) -> list[dict]:
    """Measure every job; returns the result rows (also handed to ``after_row`` after each)."""
    from tqdm import tqdm

    log = log or tqdm.write
    results: list[dict] = []
    with tqdm(total=len(jobs), desc="rows", unit="row", position=0) as rows_bar:
        for job in jobs:
            attention = None if job.mode is None else attention_section(job.mode, job.eps, calibration, extra)
            reason = tree_refusal(model, attention) if job.mode == "tree" else None
            if reason is not None:
                result = refused(job, reason)
            else:
                with tqdm(total=len(clips), desc=job.label, unit="clip", position=1, leave=False) as bar:
                    try:
                        if job.row == "stock":
                            texts, seconds = stock_llm(model, clips, warmup, work)
                            bar.update(len(clips))
                            budget = None
                        else:
                            texts, seconds, budget = served(model, job, clips, warmup, work, attention, bar)
                        result = summarize(job, references, texts, seconds, budget)
                    except RuntimeError as exc:
                        if job.mode is None:
                            raise
                        result = refused(job, _last_lines(str(exc)))  # a DP mode that cannot serve
            results.append(result)
            log(f"python -m benchmarks.whisper: {describe(result)}")
            if after_row is not None:
                after_row(results)
            rows_bar.update(1)
    return results


def _last_lines(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def describe(r: dict) -> str:
    eps = "" if r.get("eps") is None else f" eps={r['eps']:g}"
    if "refused" in r:
        return f"{r['row']}{eps}: refused ({r['refused'].splitlines()[0][:200]})"
    return (f"{r['row']}{eps}: WER {r['wer']:.3f} ({r['errors']}/{r['words']} words), "
            f"{r['seconds_per_request']:.2f} s/request; e.g. {r['texts'][0]!r}")


# =========================================================================== report
def markdown(data: dict) -> str:
    rows = data["rows"]
    stock = next((r for r in rows if r["row"] == "stock" and "wer" in r), None)
    lines = [f"# python -m benchmarks.whisper ({data['device']}, {data['date']})", "",
             (f"Command: `{data['command']}`. Model: `{data['model']}`. {len(data['references'])} English "
              f"sentences spoken by espeak-ng (16 kHz WAV), transcribed greedily (temperature 0, at most "
              f"{data['max_tokens']} tokens), one request at a time after a public warm-up request. WER: corpus "
              "word error rate (word edits / reference words; lowercase, no punctuation; above 1 when a "
              "transcription inserts words). s / request: wall time of one transcription (client side; "
              "`stock`: one `LLM.generate` call), server start excluded. DP rows: each request's encoder "
              f"output (1500 rows) is the private context; eps for the whole model (4 cross-attention layers "
              f"x 6 KV heads) per request, delta = {DELTA:g}; eps = 1e7 (composition basic) leaves the kernel "
              f"error alone. Public bounds: {data['calibration']['description']}."), "",
             table(["row", "mode", "eps", "composition", "WER", "word errors", "empty", "s / request",
                    "vs stock WER"],
                   [[r["row"], r.get("mode") or "", "" if r.get("eps") is None else f"{r['eps']:g}",
                     r.get("composition") or "",
                     "refused" if "refused" in r else f"{r['wer']:.3f}",
                     "" if "refused" in r else f"{r['errors']}/{r['words']}",
                     "" if "refused" in r else f"{r.get('empty', 0)}/{r['n']}",
                     "" if "refused" in r else f"{r['seconds_per_request']:.2f}",
                     "" if "refused" in r or stock is None else f"{r['wer'] - stock['wer']:+.3f}"]
                    for r in rows])]
    checks = data.get("checks", {})
    for name, text in (("dp_off_equals_stock", "`dp_off` transcribes every sentence exactly as `stock`"),
                       ("stock_server_equals_stock", "`stock_server` transcribes every sentence exactly as `stock`")):
        check = checks.get(name)
        if check is not None:
            verdict = "yes" if check["equal"] else f"NO (sentences {check['differ']} differ)"
            lines += ["", f"{text}: **{verdict}**."]
    if any(r["row"] == "stock_server" for r in rows):
        lines += ["", ("`stock_server` is stock `vllm serve`: its transcription endpoint prompts every Whisper with "
                       "`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`; English-only checkpoints were "
                       "trained without the language and task tokens (the plugin drops them for `*.en` models, "
                       "`serving.whisper`), which is why `stock` uses the `LLM` API with tiny.en's own prompt.")]
    refusals = [r for r in rows if "refused" in r]
    if refusals:
        lines += ["", "Refused rows:", ""]
        lines += [f"- `{r['row']}` eps={r['eps']:g}: {r['refused'].splitlines()[0]}" for r in refusals]
    budgets = [r for r in rows if r.get("budget")]
    if budgets:
        first = budgets[0]["budget"]
        lines += ["", (f"DP privacy statements (`GET /v1/dp/budget`, unit: {first.get('unit', '')}; "
                       f"context: {first.get('context', '')}):"), "",
                  table(["row", "eps", "spent eps", "spent delta", "per release (layer, KV head)", "noise std",
                         "logit bound T", "Taylor degree", "kernel error"],
                        [[r["row"], f"{r['eps']:g}", fmt(r["budget"]["spent"]["epsilon"]),
                          fmt(r["budget"]["spent"]["delta"]),
                          f"eps {fmt(r['budget']['per_release']['epsilon'])}, {r['budget']['per_release']['mechanism']}",
                          _span(r["budget"].get("noise_std")), _span(r["budget"].get("logit_bound")),
                          _span(r["budget"].get("taylor_degree")), _span(r["budget"].get("kernel_error"))]
                         for r in budgets])]
    lines += ["", "Sample transcriptions (first sentences):", ""]
    for i in range(min(SAMPLES, len(data["references"]))):
        lines += [f"{i + 1}. reference: {data['references'][i]}"]
        lines += [f"   - `{Job(r['row'], r.get('eps')).label}`: {_quoted(r['texts'][i])}" for r in rows if "texts" in r]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    text = " ".join(text.split())
    return f"“{text}”" if text else "(empty)"


def _span(values) -> str:
    """min-max of per-layer values; None (no guarantee) shown as unbounded."""
    if not values:
        return ""
    known = [v for v in values if v is not None]
    if not known:
        return "unbounded"
    low, high = min(known), max(known)
    span = fmt(low) if low == high else f"{fmt(low)}-{fmt(high)}"
    return span + (f" ({len(values) - len(known)} unbounded)" if len(known) < len(values) else "")


def plot(data: dict, path: Path) -> None:
    """WER vs eps (log x), one curve per DP mode; ``stock`` and ``dp_off`` as horizontal lines."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = [r for r in data["rows"] if "wer" in r]
    for name, style in (("stock", {"color": "C7", "ls": "--"}), ("dp_off", {"color": "C2", "ls": ":"})):
        r = next((r for r in rows if r["row"] == name), None)
        if r is not None:
            ax.axhline(r["wer"], lw=1.2, label=f"{name} (WER {r['wer']:.3f})", **style)
    highest = max([1.0, *(r["wer"] for r in rows)])
    for i, mode in enumerate(MODES):
        points = sorted((r["eps"], r["wer"]) for r in rows if r.get("mode") == mode)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i}",
                    label=f"dp_{mode}")
        refusals = [r["eps"] for r in data["rows"] if r.get("mode") == mode and "refused" in r]
        if refusals:
            ax.plot(refusals, [highest * 1.02] * len(refusals), marker="x", color=f"C{i}", ls="none",
                    label=f"dp_{mode}: refused")
    ax.set_xscale("log")
    ax.set_xlim(3, 3 * KERNEL_ONLY_EPS)
    ax.set_ylim(-0.02, highest * 1.08)
    ax.set_xlabel("eps (whole model, per request; 1e7: kernel error alone)")
    ax.set_ylabel("word error rate")
    ax.set_title(f"python -m benchmarks.whisper: {Path(data['model']).name}, {data['device']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# =========================================================================== CLI
def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"Whisper model directory (default {DEFAULT_MODEL}, built with "
                             f"`vllm-dp import-model {DEFAULT_MODEL_NAME}` when missing)")
    parser.add_argument("--rows", type=names, default=BASE_ROWS,
                        help=f"comma-separated non-private rows of {', '.join(BASE_ROWS)} (default all)")
    parser.add_argument("--modes", type=names, default=("state",),
                        help="comma-separated DP attention modes of state, tree (default state; empty: none)")
    parser.add_argument("--eps", type=floats, default=DEFAULT_EPS,
                        help=f"eps of the DP rows, comma-separated (default {','.join(f'{e:g}' for e in DEFAULT_EPS)}; "
                             f"eps = {KERNEL_ONLY_EPS:g} is always added)")
    parser.add_argument("--calibration", default="speech",
                        help="public bounds: speech (espeak-ng speech of public sentences, default), synthetic "
                             "(`vllm-dp calibrate`: sine sweep and white noise) or a calibration file")
    parser.add_argument("--quantile", type=float, default=DEFAULT_QUANTILE,
                        help=f"clipping quantile of the speech/synthetic calibration (default {DEFAULT_QUANTILE})")
    parser.add_argument("--attention", type=json.loads, default=None, metavar="JSON",
                        help='more dp_privacy.attention keys for every DP row, e.g. \'{"degree": 1}\'')
    parser.add_argument("--limit", type=int, metavar="N", help="the first N sentences only")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 sentences, eps 8 only (no 1e7)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"result directory (default {DEFAULT_OUT})")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where calibrations are cached")
    parser.add_argument("--date", default="", help="date stamp of the result files (default today)")
    parser.add_argument("--stock-worker", metavar="JOB", help=argparse.SUPPRESS)  # the stock row's process
    return parser


@with_example
def build_parser(prog: str = "python -m benchmarks.whisper") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def settings(args: argparse.Namespace) -> tuple[list[Job], list[str]]:
    """(jobs, reference sentences) of parsed ``args`` (``--quick``, ``--limit`` applied)."""
    references = list(SENTENCES[:args.limit] if args.limit else SENTENCES)
    if args.quick:
        references = references[:2]
        jobs = [j for j in jobs_of(args.rows, args.modes, [8.0]) if j.eps in (None, 8.0)]
    else:
        jobs = jobs_of(args.rows, args.modes, args.eps)
    return jobs, references


def ensure_model(model: str) -> str:
    if (Path(model) / "config.json").exists():
        return model
    if Path(model) == Path(DEFAULT_MODEL):
        from vllm_dp_plugin.models import import_model

        return str(import_model(DEFAULT_MODEL_NAME, model))
    raise SystemExit(f"python -m benchmarks.whisper: no model at {model}")


def checks(rows: Sequence[dict]) -> dict:
    """``dp_off_equals_stock`` / ``stock_server_equals_stock`` (None where a row is missing)."""
    by = {r["row"]: r for r in rows if r.get("eps") is None}
    return {"dp_off_equals_stock": same_transcriptions(by.get("dp_off"), by.get("stock")),
            "stock_server_equals_stock": same_transcriptions(by.get("stock_server"), by.get("stock"))}


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed arguments (``add_cli_args``) or an argv list (``python -m benchmarks.whisper ...``)."""
    args, argv = parse(args, build_parser)
    if args.stock_worker:
        return stock_worker(args.stock_worker)
    jobs, references = settings(args)
    model = ensure_model(args.model)
    started = time.perf_counter()
    date = today(args.date)
    device = device_label(default_device())  # the device vLLM serves on
    stem = args.out / f"whisper-{device}-{date}"
    work = Path(tempfile.mkdtemp(prefix="vllm-dp-bench-whisper-"))
    try:
        calibration = None
        if any(j.mode for j in jobs):
            calibration = calibration_file(model, args.calibration, args.quantile, args.cache_dir)
        clips = write_clips(references, work / "clips")
        warmup = write_clips([WARMUP_SENTENCE], work / "warmup")[0]
        described = {"speech": f"calibration on espeak-ng speech of {len(CALIBRATION_SENTENCES)} public sentences "
                               f"(not the benchmark's), their transcripts as decoder input, quantile {args.quantile:g}",
                     "synthetic": "`vllm-dp calibrate` (4 s sine sweep and 4 s white noise, pydoc tokens as decoder "
                                  f"input), quantile {args.quantile:g}"}

        def write(results: list[dict]) -> None:
            data = {"model": model, "device": device, "date": date,
                    "command": command_line("python -m benchmarks.whisper", argv), "platform": platform.platform(),
                    "references": references, "max_tokens": MAX_TOKENS, "delta": DELTA,
                    "calibration": {"kind": args.calibration, "quantile": args.quantile,
                                    "file": None if calibration is None else str(calibration),
                                    "description": described.get(args.calibration, f"calibration file {args.calibration}"),
                                    "sentences": list(CALIBRATION_SENTENCES) if args.calibration == "speech" else None},
                    "attention_extra": args.attention, "rows": results, "checks": checks(results),
                    "loadavg": loadavg(), "wall_s": time.perf_counter() - started}
            write_json(suffixed(stem, ".json"), data, indent=1)
            write_text(suffixed(stem, ".md"), markdown(data))
            plot(data, suffixed(stem, ".png"))

        run(model, jobs, references, clips, warmup, work, calibration, args.attention, after_row=write)
    except BaseException:
        print(f"python -m benchmarks.whisper: logs kept in {work}", file=sys.stderr)
        raise
    print(suffixed(stem, ".md").read_text())
    shutil.rmtree(work, ignore_errors=True)
    off = checks(read_json(suffixed(stem, ".json"))["rows"])["dp_off_equals_stock"]
    if off is not None and not off["equal"]:
        print(f"python -m benchmarks.whisper: dp_off differs from stock on sentences {off['differ']}: the plugin without "
              "dp_privacy.attention must be an exact pass-through", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
