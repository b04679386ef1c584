"""One end of a token: what a sequence does with the logits a step gives it (sample, stop,
stream, count), and the stats it reports. Session.generate (one sequence) and the batch engine
(many at once) both call TokenEnd, so their tokens, stop reasons and stats are the same."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .grammar import prepare_row
from .sampling import SamplingConfig, sample


@dataclass
class PhaseStats:
    """Time in prefill and in decode steps, and the rates they give: the names and meanings
    a sequence's Stats and the batch engine's EngineStats share. A subclass gives the token
    counts the rates divide, `prefill_tokens` and `decode_tokens` (as fields or properties)."""

    prefill_s: float = 0.0  # time in prefill (every chunk)
    decode_s: float = 0.0  # time in decode steps (sampling included)

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens prefilled per second of prefill."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens fed through decode steps per second of them."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class Stats(PhaseStats):
    """The facts every run reports (stats line and --json use these names)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    kv_bytes: int = 0
    kv_bytes_full: int = 0
    peak_mem_bytes: int = 0
    stop_reason: str = ""  # "eos" | "length" | "context" | "interrupt" | "cancelled"
    ttft_s: float = 0.0  # time to first token: the prefill and the first sample

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens

    @property
    def decode_tokens(self) -> int:
        # the first generated token comes from the prefill's logits, so n-1 decode steps
        return max(self.generated_tokens - 1, 0)

    def as_dict(self) -> dict:
        d = asdict(self)
        d = {k: d.pop(k) for k in ("prompt_tokens", "generated_tokens")} | d  # --json's order
        d["prefill_tok_s"] = round(self.prefill_tok_s, 2)
        d["decode_tok_s"] = round(self.decode_tok_s, 2)
        d["kv_ratio"] = round(self.kv_bytes / self.kv_bytes_full, 4) if self.kv_bytes_full else 1.0
        return d


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of its logits, before any
    sampling filter) and the `top` most likely alternatives at that position, best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """TokenLogprob of tokens[i] under logits[i] (R, V), with `top` alternatives each."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).view(-1, 1)).squeeze(1)  # (R,)
    alts = lp.topk(top, dim=-1) if top > 0 else None
    out = []
    for i, (t, v) in enumerate(zip(tokens, chosen.tolist(), strict=True)):
        pairs = []
        if alts is not None:
            pairs = list(zip(alts.indices[i].tolist(), alts.values[i].tolist(), strict=True))
        out.append(TokenLogprob(int(t), v, pairs))
    return out


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list)
    # with Request.logprobs / prompt_logprobs (kvrun.engine): one entry per generated token,
    # and one per prompt token after the first
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


def penalty_window(tokens: list[int], sampling: SamplingConfig) -> list[int]:
    """The tokens --repeat-last-n looks back over: the last n, none for 0, all for -1 (the
    whole context, as llama.cpp)."""
    n = sampling.repeat_last_n
    if n == 0 or sampling.repeat_penalty == 1.0:
        return []
    return tokens if n < 0 else tokens[-n:]


class TokenEnd:
    """One sequence's side of every step: from the next-token logits to the token the next
    step feeds, or to the end of the sequence, with its text streamed and its stats kept.

    limit: the most tokens to generate; context: the session's context (a token that would
    not fit ends the sequence, "context"); after: the prompt's last token (the streamed text
    of the first piece depends on it); stop: polled after each token, True ends the sequence
    with stop_reason `stop_reason` (Ctrl-C: "interrupt"; a client gone: "cancelled");
    logprobs: keep each token's log-probability with this many alternatives (on_token gets
    it, or None, before the token's text reaches on_text); constraint: a grammar
    (kvrun.run.grammar.Constraint) that masks the logits and ends the sequence once complete."""

    def __init__(
        self,
        tokenizer,
        sampling: SamplingConfig,
        limit: int,
        context: int,
        seed: int | None = None,
        after: int | None = None,
        on_text: Callable[[str], None] | None = None,
        on_token: Callable[[int, TokenLogprob | None], None] | None = None,
        logprobs: int | None = None,
        stop: Callable[[], bool] | None = None,
        stop_reason: str = "cancelled",
        constraint=None,
    ):
        self.tokenizer, self.sampling = tokenizer, sampling
        self.limit, self.context = limit, context
        self.on_text, self.on_token, self.want_logprobs = on_text, on_token, logprobs
        self.stop, self.stop_reason = stop, stop_reason
        self.constraint = constraint
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(seed if seed is not None else torch.seed())
        self.stream = tokenizer.stream(after=after)
        self.stats = Stats()
        self.out: list[int] = []  # the generated tokens (a stop token is not one)
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.t0 = time.perf_counter()  # the first token's time counts from here
        self.t_prefill = 0.0  # when the prefill ended (decode time counts from there)

    def prefilled(self, device: torch.device) -> None:
        """Mark the end of the prefill: decode time starts, and a sequence that is not
        stopped otherwise ends by its length."""
        sync(device)
        self.t_prefill = time.perf_counter()
        self.stats.stop_reason = "length"

    def take(self, logits: torch.Tensor, tokens: list[int]) -> int | None:
        """Sample the next token from logits (V,) after `tokens` (every token the cache holds,
        in order); return it when the next step feeds it, or None when the sequence ends
        here (stats.stop_reason says why)."""
        row = logits.float().cpu()  # (V,)
        ignore_eos, stops = self.sampling.ignore_eos, self.tokenizer.stop_ids
        row = prepare_row(row, self.constraint, ignore_eos, stops)
        tok = sample(row, self.sampling, penalty_window(tokens, self.sampling), self.gen)
        if not self.stats.ttft_s:
            self.stats.ttft_s = time.perf_counter() - self.t0
        if tok in self.tokenizer.stop_ids:
            self.stats.stop_reason = "eos"
            return None
        self.out.append(tok)
        if self.constraint is not None:  # KvrunError: the grammar engine refusing its own mask
            self.constraint.accept(tok)
        entry = None
        if self.want_logprobs is not None:
            entry = token_logprobs(logits.view(1, -1), [tok], self.want_logprobs)[0]
            self.logprobs.append(entry)
        if self.on_token:
            self.on_token(tok, entry)
        self._emit(self.stream.push(tok))
        if self.stop and self.stop():
            self.stats.stop_reason = self.stop_reason
            return None
        if len(self.out) >= self.limit:
            return None
        if self.constraint is not None and self.constraint.finished:
            self.stats.stop_reason = "eos"  # the grammar's text is complete
            return None
        if len(tokens) + 1 > self.context:
            self.stats.stop_reason = "context"
            return None
        return tok

    def _emit(self, piece: str) -> None:
        if piece:
            self.text.append(piece)
            if self.on_text:
                self.on_text(piece)

    def finish(self, kv, device: torch.device, prompt_ids: list[int], **extra) -> Result:
        """Flush the streamed text, fill the stats and give the Result (extra: its other
        fields, such as prompt_logprobs)."""
        self._emit(self.stream.flush())
        sync(device)
        st = self.stats
        st.decode_s = time.perf_counter() - self.t_prefill if self.t_prefill else 0.0
        st.generated_tokens = len(self.out)
        st.kv_bytes = kv.nbytes()
        st.kv_bytes_full = kv.nbytes_full()
        st.peak_mem_bytes = peak_memory_bytes(device)
        logprobs = self.logprobs if self.want_logprobs is not None else None
        return Result("".join(self.text), list(self.out), st, prompt_ids, logprobs, **extra)
