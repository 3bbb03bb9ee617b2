"""The mask token of a parallel drafter (DFlash, P-EAGLE): a verifier token id chat text never holds.

The drafter's mask slots are embedded with a learned vector that vLLM puts in place of the verifier's
embedding row of this id, so the id must be one the drafter never reads as a real token. z-lab's Qwen3
drafters use a padded row past the tokenizer; SmolLM2's vocabulary has no spare row (49,152 rows, 49,152
tokens), so the default is the verifier's highest special token that is neither the beginning nor the end
of a sequence and that its chat template never writes (SmolLM2: 16, `<empty_output>`, a Jupyter marker of
its pre-training code data).
"""

from __future__ import annotations

import json
from pathlib import Path

from speculators.errors import SpeculatorsError


def default_mask_token_id(directory: Path) -> int:
    """The highest special token of the tokenizer in `directory` that no chat renders: not bos or eos, and
    not named in the chat template. One error line when there is none (then pass --mask-token-id)."""
    directory = Path(directory)
    config = read_json(directory / "tokenizer_config.json")
    template = config.get("chat_template") or ""
    if isinstance(template, list):  # (named templates)
        template = " ".join(str(entry.get("template", "")) for entry in template if isinstance(entry, dict))
    jinja = directory / "chat_template.jinja"  # (where transformers 5 writes it)
    if jinja.is_file():
        template += jinja.read_text()
    specials = {
        int(token_id): str(token.get("content"))
        for token_id, token in (config.get("added_tokens_decoder") or {}).items()
        if isinstance(token, dict) and token.get("special")
    }
    for token in read_json(directory / "tokenizer.json").get("added_tokens") or []:
        if isinstance(token, dict) and token.get("special") and isinstance(token.get("id"), int):
            specials[token["id"]] = str(token.get("content"))
    ends = {str(config.get(key)) for key in ("bos_token", "eos_token") if config.get(key)}
    candidates = [token_id for token_id, content in specials.items() if content not in ends and content not in template]
    if not candidates:
        raise SpeculatorsError(
            f"the verifier's tokenizer ({directory}) has no special token its chat template leaves unused; pass "
            f"--mask-token-id (a verifier token id chat text never holds)"
        )
    return max(candidates)


def read_json(path: Path) -> dict:
    """A tokenizer file's JSON object ({} when the file is absent)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        raise SpeculatorsError(
            f"{path} cannot be read to choose the mask token; pass --mask-token-id (a verifier token id chat text "
            f"never holds)"
        ) from None
    return data if isinstance(data, dict) else {}
