"""References shared by the CPU and GPU suites."""

from __future__ import annotations

import nnsight


def assert_outputs_as_results(outputs: list[dict], model, prompts: list[str], **how) -> None:
    """``trace(blocking=False, outputs=True)``'s outputs equal, invoke by invoke, the prompt ids, token ids
    and text that ``tracer.result`` reads in a blocking trace of the same prompts with the same settings."""
    with model.trace(**how) as reference:
        results = nnsight.save([None] * len(prompts))
        for i, prompt in enumerate(prompts):
            with reference.invoke(prompt):
                result = reference.result
                results[i] = (list(result.prompt_token_ids), list(result.outputs[0].token_ids), result.outputs[0].text)
    assert [(o["prompt_token_ids"], o["token_ids"], o["text"]) for o in outputs] == list(results)
