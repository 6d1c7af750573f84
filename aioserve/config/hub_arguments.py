"""The `vllm serve` arguments that pick what the Hugging Face hub gives: --revision,
--tokenizer-revision, --code-revision and --hf-token (vLLM's ModelConfig), declared as
arguments.py declares the others; it puts them among the model's.

Which download each applies to, and when one is refused because it would select nothing
(a local path, a packaged model), is aioserve/models/resolve.py's `check_hub_options`.
"""

from __future__ import annotations

from typing import Any

from aioserve.config import values
from aioserve.config.declaration import MODEL, Argument, vllm_only


def hf_token(value: Any) -> str | bool:
    """A token (a string), True for the one `hf auth login` stored (or $HF_TOKEN's), False
    (LLM(hf_token=False)) for none at all. The value is never repeated in an error."""
    if isinstance(value, bool) or (isinstance(value, str) and value):
        return value
    got = "an empty string" if value == "" else f"a value of type {type(value).__name__}"
    raise ValueError(
        "must be a token (a non-empty string), or true for the token stored by `hf auth "
        f"login`; got {got}"
    )


# fmt: off
HUB_ARGUMENTS: tuple[Argument, ...] = (
    Argument("revision", MODEL, None,
             "Revision (branch, tag or commit) of a Hugging Face hub model: its config, "
             "weights and generation config, and its tokenizer unless --tokenizer-revision "
             "says otherwise. With a packaged model's name it fetches the hub's repository at "
             "that revision instead of the packaged copy; a local path has no revisions and "
             "is refused with it.", convert=values.string),
    vllm_only("code-revision", MODEL, None,
              "Revision of the code a model's repository ships (its auto_map classes, run "
              "with --trust-remote-code). aioserve never runs such code, so this is refused.",
              why="is a vLLM argument that aioserve does not support: it picks the revision "
                  "of the code a model's repository ships (its auto_map classes, run with "
                  "--trust-remote-code), and aioserve never runs code shipped with a model"),
    Argument("tokenizer-revision", MODEL, None,
             "Revision (branch, tag or commit) of the tokenizer on the Hugging Face hub. "
             "Default: --revision's, as in vLLM, where the tokenizer comes from the hub.",
             convert=values.string),
    Argument("hf-token", MODEL, None,
             "Token sent to the Hugging Face hub (Authorization: Bearer) for every download "
             "of the model, its tokenizer and --hf-config-path; the bare flag sends the token "
             "stored by `hf auth login` (HF_TOKEN, when set, wins over it). Default: "
             "huggingface_hub's own choice, HF_TOKEN or the stored token. Never logged.",
             "optional", convert=hf_token),
)
# fmt: on
