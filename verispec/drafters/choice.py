"""`--method auto`: the method for a target, chosen from what it has, before anything loads.

In order: a head given with --head (its folder's config.json says whether it is an EAGLE or a Medusa head); a draft
model given with --draft; a head shipped for the target's model, found by the GGUF file's metadata
(checkpoints/shipped.py `shipped_head_for`), never by its path; else suffix decoding, which needs no model and
measured best on the coding model (docs/bench/qwen-coder-1.5b/). What the user gave comes before what ships, so that
--head and --draft are never ignored.
"""

from __future__ import annotations

from verispec.checkpoints.draft_vocab import head_section
from verispec.checkpoints.gguf_file import is_gguf
from verispec.checkpoints.shipped import shipped_head_for
from verispec.drafters.builders import Resources
from verispec.drafters.options import AUTO, Method
from verispec.errors import InvalidArgumentError

AUTO_SUMMARY = (
    "the method for the target: a head given with --head, the draft model given with --draft, a head shipped for a "
    "GGUF target's model (found by its metadata), else suffix decoding; it says which and why"
)
HEADS = ("eagle", "medusa")  # the shipped heads auto looks for, the first found taken


def choose(method: Method, res: Resources) -> Method:
    """The method `auto` (`method`, whose k, if any, is kept) picks for the target of `res`, with its `reason`."""
    if method.options:
        raise InvalidArgumentError(
            f"method {AUTO} chooses the method for the target; it takes no option ({', '.join(method.options)} given): "
            "name the method instead"
        )
    if res.head_dir is not None:
        kind = head_section(res.head_dir).get("drafter")
        if kind not in HEADS:
            raise InvalidArgumentError(
                f"method {AUTO}: {res.head_dir} is not an EAGLE or Medusa head (its config.json's verispec.drafter "
                f"is {kind!r}); name the method instead"
            )
        return Method(kind, method.k, reason=f"the {kind} head given ({res.head_dir})")
    if res.draft is not None or res.draft_dir is not None:
        return Method("draft", method.k, reason="the draft model given")
    if res.target_dir is not None and is_gguf(res.target_dir):
        for kind in HEADS:
            folder = shipped_head_for(res.target_dir, kind)
            if folder is not None:
                return Method(kind, method.k, reason=f"the {kind} head {folder.name} ships for this model")
    return Method(
        "suffix",
        method.k,
        reason="no head ships for this model and no draft model was given; suffix decoding needs no model",
    )
