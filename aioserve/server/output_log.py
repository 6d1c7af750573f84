"""--enable-log-outputs: log generated answers beside the request log, in vLLM 0.32's words.

    Generated response <id>[ (streaming delta)| (streaming complete)]: output: <text repr>,
        finish_reason: <reason>                                             (INFO)
    Generated response <id>[...] details: output_token_ids: [...]      (DEBUG, just before)

The text and the token ids are cut to --max-log-len. Which answers are logged, and when,
is vLLM's:

- chat completions (and so Anthropic's /v1/messages, which vLLM runs as chat): a whole
  answer once per choice, its content, or "[tool_calls: name(arguments), ...]" when it has
  only calls (nothing when it has neither), with its finish reason; a stream each chunk's
  delta as it is sent ("content [reasoning: ...] [tool_calls: <argument pieces>]", with
  the engine's finish reason of that step) unless --no-enable-log-deltas, then, once the
  stream has ended well, each choice's raw generated text with finish reason
  "streaming_complete" and no token ids;
- responses: the raw generated text once, with the engine's finish reason (marked
  "streaming complete" in a stream);
- /v1/completions: nothing (vLLM 0.32's completions route does not log outputs).

Output logging needs request logging (--enable-log-requests; the configuration refuses
--enable-log-outputs without it), and is off when --disable-log-requests turns that off.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from aioserve.config.frontend import FrontendConfig

logger = logging.getLogger("aioserve.server")

DELTA = " (streaming delta)"
COMPLETE = " (streaming complete)"


class OutputLog:
    """Writes the log lines of generated outputs, cut to --max-log-len."""

    def __init__(self, max_log_len: int | None, log_deltas: bool) -> None:
        self.max_log_len = max_log_len
        self.log_deltas = log_deltas

    def log(
        self,
        request_id: str,
        text: str,
        token_ids: Sequence[int] | None,
        finish_reason: str | None,
        stream_info: str = "",
    ) -> None:
        limit = self.max_log_len
        if limit is not None:
            text = text[:limit]
        if logger.isEnabledFor(logging.DEBUG):
            if limit is not None and token_ids is not None:
                token_ids = list(token_ids)[:limit]
            logger.debug(
                "Generated response %s%s details: output_token_ids: %s",
                request_id,
                stream_info,
                None if token_ids is None else list(token_ids),
            )
        logger.info(
            "Generated response %s%s: output: %r, finish_reason: %s",
            request_id,
            stream_info,
            text,
            finish_reason,
        )

    def chat_delta(
        self,
        request_id: str,
        content: str | None,
        reasoning: str | None,
        tool_calls: list[dict[str, Any]] | None,
        token_ids: Sequence[int],
        finish_reason: str | None,
    ) -> None:
        """A chat stream chunk's delta, if it has text and deltas are logged."""
        if not self.log_deltas:
            return
        parts = [content] if content else []
        if reasoning:
            parts.append(f"[reasoning: {reasoning}]")
        arguments = "".join(
            call.get("function", {}).get("arguments") or "" for call in tool_calls or []
        )
        if arguments:
            parts.append(f"[tool_calls: {arguments}]")
        if parts:
            self.log(request_id, " ".join(parts), token_ids, finish_reason, DELTA)

    def chat_choice(
        self,
        request_id: str,
        content: str | None,
        tool_calls: list[dict[str, Any]] | None,
        token_ids: Sequence[int],
        finish_reason: str | None,
    ) -> None:
        """A whole chat answer's choice: its content, else its calls."""
        text = content or ""
        if not text and tool_calls:
            described = ", ".join(
                f"{call['function']['name']}({call['function']['arguments']})"
                for call in tool_calls
            )
            text = f"[tool_calls: {described}]"
        if text:
            self.log(request_id, text, token_ids, finish_reason)


def output_log(frontend: FrontendConfig) -> OutputLog | None:
    """The output log the server's flags ask for; None when outputs are not logged."""
    if not (
        frontend.enable_log_outputs
        and frontend.enable_log_requests
        and not frontend.disable_log_requests
    ):
        return None
    return OutputLog(frontend.max_log_len, frontend.enable_log_deltas)
