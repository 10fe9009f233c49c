"""Which families keep a packed row's documents apart: ``PACKED_DOCUMENT_MODEL_TYPES`` must be
exactly those of the family matrix whose packed forward equals each document run alone, and
``check_packed_documents`` refuses the others, and other attention implementations, in one line."""
from __future__ import annotations

import pytest
import torch

from outcore.errors import ModelError
from outcore.models import PACKED_DOCUMENT_MODEL_TYPES, SUPPORTED_MODEL_TYPES, check_packed_documents
from tests.models.test_families import FAMILIES, family_config

LENGTHS = (5, 11, 16)


def _packed_equals_alone(family: str) -> bool:
    """Whether the family's packed forward (position ids restarting, no mask) gives each
    document's hidden states alone (eager attention: every family has it)."""
    import transformers

    config = family_config(family)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    docs = [torch.randint(2, 300, (1, n)) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    with torch.no_grad():
        packed = model.model(input_ids=torch.cat(docs, 1), position_ids=positions, use_cache=False)
        start, ok = 0, True
        for doc, n in zip(docs, LENGTHS):
            alone = model.model(input_ids=doc, use_cache=False).last_hidden_state
            ok &= torch.allclose(packed.last_hidden_state[:, start:start + n], alone, rtol=1e-4, atol=1e-5)
            start += n
    return bool(ok)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_list_is_the_families_that_keep_documents_apart(family):
    assert _packed_equals_alone(family) == (family in PACKED_DOCUMENT_MODEL_TYPES)


def test_the_list_is_within_the_supported_families():
    assert set(PACKED_DOCUMENT_MODEL_TYPES) <= set(SUPPORTED_MODEL_TYPES)


def test_other_families_and_attention_implementations_are_refused_in_one_line():
    import transformers

    with torch.device("meta"):
        gpt_oss = transformers.AutoModelForCausalLM.from_config(family_config("gpt_oss"))
        llama = transformers.AutoModelForCausalLM.from_config(family_config("llama"))
    with pytest.raises(ModelError, match="gpt_oss does not mask attention per document") as err:
        check_packed_documents(gpt_oss)
    assert "\n" not in str(err.value) and "padding_free=false" in str(err.value)
    check_packed_documents(llama)  # sdpa or eager: accepted
    llama.config._attn_implementation = "my_kernel"  # a kernel registered with transformers by a user
    with pytest.raises(ModelError, match="attention .my_kernel. of llama"):
        check_packed_documents(llama)
