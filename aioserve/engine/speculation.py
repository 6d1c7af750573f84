"""Speculative decoding by n-gram prompt lookup: vLLM's `--speculative-config` method "ngram".

At a decode, the sequence's last `n` tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) are looked for earlier in its prompt and output; where the longest
such n-gram first occurred, the up to `num_speculative_tokens` tokens that followed it are
the drafts. The step then computes the sequence's last token and its drafts at once, and
samples a token at each of those positions (scheduler.py, runner/speculative_rows.py).

Checking the drafts: a draft from a lookup has no probability of its own (it is one token
for sure), and for such a draft the rejection sampling of speculative decoding (accept
draft d with probability p(d), else draw from p without d) is the same as drawing a token
from p as usual and accepting the draft when the draw equals it. So every position draws
with the sampler of an ordinary decode, its penalties and min_tokens counting the drafts
before it as output, and its random stream at the token's own index (uniform.py). The
drafts are kept while they equal the draws; the first draw that differs (or the one after
the last draft) is kept too and ends the step's tokens. A sequence therefore samples
exactly the tokens it samples without speculation, seeded or not, up to the last bits of
the logits (a draft's logits come from a step of several tokens, not from a decode).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aioserve.config.speculative import NgramSpeculation


def propose_ngram_drafts(
    token_ids: Sequence[int] | np.ndarray, settings: NgramSpeculation, max_drafts: int
) -> list[int]:
    """The drafts that follow the first earlier occurrence of the longest suffix n-gram of
    `token_ids` (vLLM's choice), at most `max_drafts` of them; none without a match."""
    tokens = np.asarray(token_ids)
    length = tokens.size
    if max_drafts < 1 or length < settings.prompt_lookup_min + 1:
        return []
    # Candidate occurrences end where the last token occurs, before the last position.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    # Grow each candidate's match backwards, one token a round, up to the longest n-gram.
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(settings.prompt_lookup_max, length - 1)):
        starts = ends - back
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    longest = int(matched.max())
    if longest < settings.prompt_lookup_min:
        return []
    first = int(ends[np.argmax(matched == longest)])  # ends ascend: the first occurrence
    return tokens[first + 1 : first + 1 + max_drafts].tolist()
