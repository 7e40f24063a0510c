"""The log-probabilities a request asked for: of the tokens it sampled, of its prompt, of a scored window.

All of them are of the model's raw distribution: log_softmax of the fp32 logits, before temperature,
top-k and top-p (vLLM's default), so they do not depend on how the request samples. A token's rank
is 1 + the number of tokens with a strictly larger log-probability (1 = the argmax; ties share a rank).

- `keep_scores`: one step's piece of a `ScoreRequest`, a scored window or a generating request's prompt
  (`Sequence.prompt_scores`): the actual next token's log-probability (and rank) and the top-k at each
  position, in chunks of rows so a large vocabulary never needs a whole prompt's logits at once.
  Positions kept once are not kept again when a preempted sequence runs its prompt a second time.
- `prompt_logprobs`: a generating request's kept prompt scores as `TokenLogprob`s (entry 0 is None: the
  first token has nothing before it).
- `sampled_logprobs`: the sampled tokens' `TokenLogprob`s, from the logits the step sampled from.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from tokq.engine.sequence import ScoreRequest, TokenLogprob

SCORE_LOGITS_CHUNK = 256  # rows of full-vocabulary logits at a time (256 x 262K x 4 B = 268 MB at most)


def keep_scores(score: ScoreRequest, token_ids: Seq[int], hidden: torch.Tensor, start: int, end: int,
                logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Keep the scores of positions start..start+len(hidden)-1 that are below `end` and not kept yet.

    `hidden`: the step's final hidden states of those positions; position p scores token_ids[p + 1];
    `end`: the first position not to score (len(window) - 1 for a window, the prompt's length - 1 for
    a prompt); `logits_of`: hidden rows -> fp32 logits."""
    first, last = max(start, score.num_kept), min(start + hidden.shape[0], end)
    if last <= first:
        return
    hidden = hidden[first - start: last - start]
    targets = torch.tensor(token_ids[first + 1: last + 1], dtype=torch.int64, device=hidden.device)
    rows = targets.numel()
    for lo in range(0, rows, SCORE_LOGITS_CHUNK):
        hi = min(rows, lo + SCORE_LOGITS_CHUNK)
        logprobs = torch.log_softmax(logits_of(hidden[lo:hi]), dim=-1)
        actual = logprobs.gather(1, targets[lo:hi, None])
        score.logprobs.append(actual[:, 0].cpu())
        if score.keep_ranks:
            score.ranks.append(((logprobs > actual).sum(dim=-1) + 1).cpu())
        if score.topk:
            values, ids = logprobs.topk(score.topk, dim=-1)
            score.topk_logprobs.append(values.cpu())
            score.topk_ids.append(ids.cpu())
        if score.gather_ids is not None:
            wanted = score.gather_ids[first + lo: first + hi].to(logprobs.device)
            score.gathered.append(logprobs.gather(1, wanted).cpu())
        if score.full_rows is not None:
            keep = score.full_rows[first + lo: first + hi].to(logprobs.device)
            if bool(keep.any()):  # only the selected rows leave the chunk: memory stays rows x vocab
                score.full_logprobs.append(logprobs[keep].cpu())
    score.num_kept = last


def prompt_logprobs(score: ScoreRequest, prompt: Seq[int]) -> list[TokenLogprob | None]:
    """Entry i (i >= 1): prompt[i]'s log-probability given prompt[:i], its rank and the top-k; entry 0: None."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    logprobs = torch.cat(score.logprobs).tolist()
    ranks = torch.cat(score.ranks).tolist()
    if score.topk:
        tops = [list(zip(ids, values, strict=True)) for ids, values in
                zip(torch.cat(score.topk_ids).tolist(), torch.cat(score.topk_logprobs).tolist(), strict=True)]
    else:
        tops = [[] for _ in logprobs]
    assert len(logprobs) == len(prompt) - 1, "every prompt position must have been scored"
    return [None] + [TokenLogprob(token, lp, rank, top) for token, lp, rank, top
                     in zip(prompt[1:], logprobs, ranks, tops, strict=True)]


def sampled_logprobs(logits: torch.Tensor, tokens: Seq[int], ks: Seq[int | None]) -> list[TokenLogprob | None]:
    """Per row of fp32 `logits` [B, V], the TokenLogprob of tokens[row] with ks[row] alternatives, or None
    where ks[row] is None; one log_softmax and top-k over the rows that asked only."""
    out: list[TokenLogprob | None] = [None] * len(ks)
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in rows], device=logits.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    k = max(ks[i] for i in rows)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values, ids, chosen = values.tolist(), ids.tolist(), chosen[:, 0].tolist()
    for j, i in enumerate(rows):
        top = list(zip(ids[j][: ks[i]], values[j][: ks[i]], strict=True))
        out[i] = TokenLogprob(int(tokens[i]), chosen[j], ranks[j], top)
    return out
