"""A compare side that is a URL: score windows of token ids through an OpenAI-compatible completions endpoint.

Each window is one `POST /v1/completions` with prompt = the window's token ids, max_tokens = 0 (1 where the
server refuses 0; the generated token is dropped), echo = true and, first choice, `prompt_logprobs = k` (vLLM's
extension, served by `tokq serve`: per prompt position {token_id: {logprob, rank}} holding the actual token and
the top-k). A server without it (llama.cpp's server, OpenAI's legacy completions) is asked `logprobs = k` with
echo instead: token strings and top_logprobs {token_string: logprob}; those strings are mapped back to ids with
the local tokenizer (a string several ids decode to is dropped, and that row then carries no cap: the bound stays
rigorous). k = min(--topk-remote, what the server accepts), 20 by default (vLLM's default --max-logprobs).

Tokenization agreement: the side must have scored the ids that were sent. Where the server echoes ids
(prompt_token_ids, or the prompt_logprobs keys) they are checked against the window; where it echoes strings they
are checked against the local tokenizer's per-token strings. A mismatch is a DataError naming the first differing
position and both tokens.

Requests run `max_concurrency` at a time (threads over one EndpointClient, which retries 429/503 with backoff),
so a fleet behind the URL sets the throughput. What comes back per window is a `topk_bounds.PartialRows` over
the window's scored rows (row p predicts token p + 1, as the engine's WindowScores). Every number in an answer
passes answer_checks first (log-probabilities <= 0 and not NaN, at most probability 1 listed per position, the
alternatives asked for present); an answer of another shape is a DataError, never a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import parse_qsl

import torch

from tokq.errors import ConfigError, DataError
from tokq.evalsuite.topk_bounds import PartialRows
from tokq.remote import answer_checks as checks
from tokq.remote.urls import check_http_url, redact, split_credentials

DEFAULT_TOPK = 20  # vLLM's default --max-logprobs
_FALLBACK_TOPK = (20, 10, 5, 1)
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")  # vLLM's --return-tokens-as-token-ids form


@dataclass
class EndpointSpec:
    """A side written `url=http://host:port[/v1][#model=NAME&tokenizer=DIR&topk=K]` (the fragment is never
    sent: it names the served model, the tokenizer to build windows with, and the top-k to ask for)."""

    url: str  # without user:password: what messages and results show
    model: str | None = None
    tokenizer: str | None = None
    topk: int = DEFAULT_TOPK
    connect_url: str = ""  # the address as given (credentials included): only the HTTP client sees it

    @property
    def label(self) -> str:
        return f"{self.url}" + (f" ({self.model})" if self.model else "")


def parse_side(text: str) -> EndpointSpec | None:
    """An EndpointSpec for `url=...`, None for anything else (a variant, zoo name or checkpoint)."""
    if not text.startswith("url="):
        return None
    url, _, fragment = text[4:].partition("#")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{redact(text)!r}: a URL side is url=http://host:port[/v1][#model=NAME&tokenizer=DIR]")
    check_http_url(url, "the URL side")
    keys = dict(parse_qsl(fragment, keep_blank_values=True)) if fragment else {}
    unknown = set(keys) - {"model", "tokenizer", "topk"}
    if unknown:
        raise ConfigError(f"{redact(text)!r}: unknown key {sorted(unknown)[0]!r} after '#'; known: model, tokenizer, "
                          "topk")
    topk = keys.get("topk", str(DEFAULT_TOPK))
    if not topk.isdigit() or int(topk) < 1:
        raise ConfigError(f"{redact(text)!r}: topk={topk} must be an integer >= 1")
    clean, _ = split_credentials(url)
    return EndpointSpec(clean.rstrip("/"), keys.get("model") or None, keys.get("tokenizer") or None, int(topk),
                        url.rstrip("/"))


class EndpointScorer:
    """Scores windows of token ids at one endpoint (see the module docstring)."""

    def __init__(self, spec: EndpointSpec, tokenizer, max_concurrency: int = 8, client=None,
                 timeout_s: float = 600.0):
        from tokq.remote.http import EndpointClient

        if max_concurrency < 1:
            raise ConfigError(f"--max-concurrency {max_concurrency}: must be >= 1")
        self.spec, self.tokenizer, self.max_concurrency = spec, tokenizer, max_concurrency
        self.client = client or EndpointClient(spec.connect_url, timeout_s=timeout_s)
        self.model = spec.model or self.client.first_model_id()
        self.mode = "prompt_logprobs"  # or "logprobs" (legacy echo) once the server refuses the extension
        self.topk = spec.topk
        self.max_tokens = 0
        self._pieces: list[str] | None = None
        self._ids_of: dict[str, int] | None = None

    # -- requests -----------------------------------------------------------------------------------------------
    def _body(self, tokens: Sequence[int]) -> dict:
        body = {"model": self.model, "prompt": list(tokens), "max_tokens": self.max_tokens, "echo": True,
                "temperature": 0.0}
        if self.mode == "prompt_logprobs":
            body.update(prompt_logprobs=self.topk, return_token_ids=True)
        else:
            body["logprobs"] = self.topk
        return body

    def _post(self, tokens: Sequence[int]) -> dict:
        return self.client.post_json("/v1/completions", self._body(tokens))

    def _settle(self, tokens: Sequence[int]) -> dict:
        """The first request, adapting to what the server accepts: max_tokens 0 or 1, prompt_logprobs or legacy
        logprobs, the largest k it allows. Later requests are sent as this one was."""
        from tokq.remote.http import EndpointError

        wanted = [k for k in (self.spec.topk, *_FALLBACK_TOPK) if k <= self.spec.topk]
        last: Exception | None = None
        for mode in ("prompt_logprobs", "logprobs"):
            for k in dict.fromkeys(wanted):
                for max_tokens in (0, 1):
                    self.mode, self.topk, self.max_tokens = mode, k, max_tokens
                    try:
                        answer = self._post(tokens)
                    except EndpointError as exc:
                        if exc.status != 400:
                            raise
                        last = exc
                        continue
                    try:
                        choice = (answer.get("choices") or [{}])[0]
                        choice.get("prompt_logprobs")
                    except (AttributeError, TypeError, IndexError, KeyError) as exc:
                        raise checks.malformed(self.spec.label, "the first window", exc) from None
                    if mode == "prompt_logprobs" and not choice.get("prompt_logprobs"):
                        break  # the extension is ignored here: try the legacy form
                    if mode == "logprobs" and not choice.get("logprobs"):
                        break
                    return answer
                else:
                    continue
                break
        raise DataError(f"{self.spec.url}: the server returns no prompt log-probabilities (neither prompt_logprobs "
                        f"nor logprobs with echo; last error: {last}); start it with prompt logprobs enabled "
                        "(vLLM: --max-logprobs >= k) or use tokq serve")

    def score(self, windows: Sequence, progress: Callable[[int], None] | None = None) -> list[PartialRows]:
        """One PartialRows per window (its scored rows), requests `max_concurrency` at a time."""
        if not windows:
            return []
        first = self._settle(windows[0].tokens)
        out = [self._rows(windows[0], first)]
        if progress:
            progress(1)

        def one(window) -> PartialRows:
            rows = self._rows(window, self._post(window.tokens))
            if progress:
                progress(1)
            return rows

        with ThreadPoolExecutor(self.max_concurrency) as pool:
            out += list(pool.map(one, windows[1:]))
        return out

    # -- answers ------------------------------------------------------------------------------------------------
    def _rows(self, window, answer: dict) -> PartialRows:
        try:
            return self._parse_rows(window, answer)
        except DataError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:  # a shape no server sends
            where = f"{getattr(window, 'doc_id', '?')} window {getattr(window, 'window_index', '?')}"
            raise checks.malformed(self.spec.label, where, exc) from None

    def _parse_rows(self, window, answer: dict) -> PartialRows:
        if not isinstance(answer, dict):
            raise TypeError(f"the answer is a {type(answer).__name__}, not an object")
        choice = (answer.get("choices") or [None])[0]
        if not isinstance(choice, dict):
            raise DataError(f"{self.spec.url}: a completion answer without choices; is this an OpenAI-compatible "
                            "server?")
        tokens = list(window.tokens)
        first = max(window.score_from, 1)
        if self.mode == "prompt_logprobs":
            echoed = choice.get("prompt_token_ids")
            if echoed is not None:
                self._check_ids(tokens, [int(t) for t in echoed])
            entries = choice.get("prompt_logprobs") or []
            return self._from_prompt_logprobs(tokens, entries, first)
        return self._from_legacy(tokens, choice.get("logprobs") or {}, first)

    def _mismatch(self, position: int, sent: int, got: str) -> DataError:
        return DataError(f"{self.spec.label} scored other tokens than were sent: at position {position} it has "
                         f"{got}, the local tokenizer {self._piece(sent)!r} (id {sent}); use the same tokenizer / "
                         "model on both sides (#tokenizer=DIR names the served model's tokenizer)")

    def _check_ids(self, sent: list[int], echoed: list[int]) -> None:
        for i, (s, e) in enumerate(zip(sent, echoed, strict=False)):
            if s != e:
                raise self._mismatch(i, s, f"{self._piece(e)!r} (id {e})")
        if len(echoed) != len(sent):
            raise DataError(f"{self.spec.label} echoed {len(echoed)} prompt tokens for {len(sent)} sent: use the "
                            "same tokenizer / model on both sides")

    def _from_prompt_logprobs(self, tokens: list[int], entries: list, first: int) -> PartialRows:
        if len(entries) < len(tokens):
            raise DataError(f"{self.spec.label}: prompt_logprobs has {len(entries)} entries for {len(tokens)} prompt "
                            "tokens: the server truncated or re-tokenized the prompt; use the same tokenizer / model")
        n, k = len(tokens) - first, self.topk
        actual = torch.empty(n)
        ids, values = torch.full((n, k), -1, dtype=torch.long), torch.full((n, k), float("nan"))
        cap, top1, top1_lp = torch.zeros(n), torch.empty(n, dtype=torch.long), torch.empty(n)
        label, wanted = self.spec.label, min(k, len(self.tokenizer)) if self.tokenizer is not None else k
        for row, pos in enumerate(range(first, len(tokens))):
            entry = entries[pos] or {}
            where = f"prompt position {pos}"
            own = entry.get(str(tokens[pos]))
            if own is None:
                shown = ", ".join(f"id {key}" for key in list(entry)[:3]) or "nothing"
                raise self._mismatch(pos, tokens[pos], f"no log-probability for it ({shown})")
            actual[row] = checks.logprob(label, where, own["logprob"])
            listed = {int(key): checks.logprob(label, where, v["logprob"]) for key, v in entry.items()}
            checks.mass(label, where, list(listed.values()))
            ranked = sorted(((int(v["rank"]), int(key), listed[int(key)]) for key, v in entry.items()
                             if v.get("rank") is not None and int(v["rank"]) <= k))
            checks.alternatives(label, where, len(ranked), wanted)
            for j, (_, tid, lp) in enumerate(ranked[:k]):
                ids[row, j], values[row, j] = tid, lp
            # every id outside the top-k is <= the k-th value; fewer than k listed: no cap is known
            cap[row] = ranked[k - 1][2] if len(ranked) >= k else 0.0
            best = ranked[0] if ranked and ranked[0][0] == 1 else (1, tokens[pos], actual[row].item())
            top1[row], top1_lp[row] = best[1], best[2]
        return PartialRows(actual, ids, values.nan_to_num(-torch.inf), cap, top1, top1_lp)

    def _piece(self, token_id: int) -> str:
        if self._pieces is None:
            vocab = len(self.tokenizer)
            self._pieces = [self.tokenizer.decode([i]) for i in range(vocab)]
        return self._pieces[token_id] if 0 <= token_id < len(self._pieces) else f"<id {token_id}>"

    def _id_of(self, text: str) -> int | None:
        """A returned token string back to its id (None: several ids decode to it, or none)."""
        match = _TOKEN_ID.match(text)
        if match:
            return int(match.group(1))
        if self._ids_of is None:
            self._piece(0)
            seen: dict[str, int] = {}
            for i, piece in enumerate(self._pieces):
                seen[piece] = -1 if piece in seen else i
            self._ids_of = seen
        found = self._ids_of.get(text, -1)
        return None if found < 0 else found

    def _from_legacy(self, tokens: list[int], logprobs: dict, first: int) -> PartialRows:
        strings = logprobs.get("tokens") or []
        token_lps = logprobs.get("token_logprobs") or []
        tops = logprobs.get("top_logprobs") or []
        if len(strings) < len(tokens) or len(token_lps) < len(tokens):
            raise DataError(f"{self.spec.label}: logprobs with echo cover {len(strings)} tokens for {len(tokens)} "
                            "sent: the server re-tokenized the prompt; use the same tokenizer / model")
        for i, (sent, got) in enumerate(zip(tokens, strings, strict=False)):
            match = _TOKEN_ID.match(got)
            if (int(match.group(1)) != sent) if match else (got != self._piece(sent)):
                raise self._mismatch(i, sent, repr(got))
        n, k, label = len(tokens) - first, self.topk, self.spec.label
        actual = torch.tensor([checks.logprob(label, f"prompt position {p}", token_lps[p])
                               for p in range(first, len(tokens))])
        ids, values = torch.full((n, k), -1, dtype=torch.long), torch.full((n, k), -torch.inf)
        cap, top1, top1_lp = torch.zeros(n), torch.empty(n, dtype=torch.long), torch.empty(n)
        for row, pos in enumerate(range(first, len(tokens))):
            where = f"prompt position {pos}"
            listed = {text: checks.logprob(label, where, lp) for text, lp in (tops[pos] or {}).items()}
            checks.mass(label, where, list(listed.values()))
            # keyed by token strings, the legacy form merges tokens that decode alike: a few fewer than k may come
            checks.alternatives(label, where, len(listed), -(-k // 2))
            ranked = sorted(((lp, text) for text, lp in listed.items()), reverse=True)[:k]
            mapped = [(self._id_of(text), lp) for lp, text in ranked]
            for j, (tid, lp) in enumerate(mapped):
                if tid is not None:
                    ids[row, j], values[row, j] = tid, lp
            complete = len(ranked) >= k and all(tid is not None for tid, _ in mapped)
            cap[row] = ranked[-1][0] if complete else 0.0  # an unmapped top entry may be above any cap
            if mapped and mapped[0][0] is not None:
                top1[row], top1_lp[row] = mapped[0][0], ranked[0][0]
            else:  # the argmax is unknown: the actual token stands in (top-1 agreement then reads as unknown)
                top1[row], top1_lp[row] = tokens[pos], actual[row]
        return PartialRows(actual, ids, values, cap, top1, top1_lp)
