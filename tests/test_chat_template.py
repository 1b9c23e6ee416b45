"""Chat templates come from the model file, a stranger's file: a hostile or broken one ends in
one SharkportError naming the file, quickly and in bounded memory, never a hang or a traceback
(sharkport/chat_template.py). Real templates still render as transformers does
(tests/test_tokenizer.py)."""

import time

import pytest

from sharkport.archive import Dataset
from sharkport.errors import SharkportError

HOSTILE = {
    "nested-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "steps"),
    "string-doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s }}", "built a string"),
    "repeat": ("{{ 'ab' * 1000000000 }}", "would build a sequence"),
    "list-repeat": ("{{ ([1] * 1000000000)|length }}", "would build a sequence"),
    "center": ("{{ 'x'|center(1000000000) }}", "to the filter"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "wrote more than"),
    "power": ("{{ 2 ** 1000000000 }}", "power"),
    "format": ("{{ '%0999999999d' % 1 }}", "field wider"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
    "include": ("{% include 'other.jinja' %}", "failed on these messages"),
    "raise": ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
}


@pytest.fixture(scope="module")
def smollm2_dataset(smollm2_gguf):
    return Dataset.load(smollm2_gguf)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_template_is_one_line_naming_the_file(smollm2_dataset, case):
    import tracemalloc

    source, message = HOSTILE[case]
    smollm2_dataset.metadata["tokenizer"]["tokenizer.chat_template"] = source
    tokenizer = smollm2_dataset.tokenizer()
    t0 = time.perf_counter()
    # the rendering's own peak (the process's peak RSS would hide it below an earlier test's)
    tracemalloc.start()
    try:
        with pytest.raises(SharkportError, match=message) as e:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 30
    assert peak < 200 * 2**20, peak
    assert str(e.value).startswith(f"{smollm2_dataset.path}: ") and "\n" not in str(e.value)
