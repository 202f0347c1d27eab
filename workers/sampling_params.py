"""Per-request sampling parameters, validated on construction.

Worked example: ``SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=64,
stop=["\\n\\n"])`` samples from the 95% nucleus of the temperature-0.8 distribution with a private
generator seeded by 7 (same seed, same prompt -> same text, whatever else is in the batch), and
stops at 64 tokens or just before the first blank line.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.errors import InvalidRequestError

_MAX_STOP_STRINGS = 16
_MAX_STOP_STRING_LEN = 256


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 disables top-k; top_p 1.0 disables top-p.

    stop: strings that end generation; the returned text stops just before them.
    stop_token_ids: token ids that end generation (kept in the output ids, like EOS).
    ignore_eos: keep generating past the model's EOS tokens (benchmarks).
    num_speculative_tokens: speculative decoding for this request: None = the deployment's setting,
        0 = off, n = draft at most n tokens per step (capped by the deployment's maximum).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so params stay hashable and immutable.
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InvalidRequestError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > _MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {_MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= _MAX_STOP_STRING_LEN:
                raise InvalidRequestError(
                    "stop", f"each stop string must be a non-empty str of at most {_MAX_STOP_STRING_LEN} chars"
                )
        if self.num_speculative_tokens is not None and not (
                isinstance(self.num_speculative_tokens, int) and 0 <= self.num_speculative_tokens <= 64):
            raise InvalidRequestError("num_speculative_tokens",
                                      f"must be an integer in [0, 64] (0 = off), got {self.num_speculative_tokens!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise InvalidRequestError("stop_token_ids", f"must be integers >= 0, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
