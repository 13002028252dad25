"""`SamplingParams(structured=...)`: the engine masks every constrained row by its grammar, so outputs
parse; a bad constraint is a clear ValueError at submission; drafts are checked against the grammar, so
speculation stays lossless; the mask pass equals xgrammar's own kernel."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from hf_paged import Engine, SamplingParams, StructuredOutputs

xgr = pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("kwargs,error", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1, 2]), "must be a JSON object"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", ""]), "non-empty list"),
    (dict(regex=""), "non-empty string"),
])
def test_a_malformed_constraint_is_refused_with_its_name(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        SamplingParams(structured=StructuredOutputs(**kwargs)).validate()
    with pytest.raises(TypeError, match="structured must be a StructuredOutputs"):
        SamplingParams(structured={"json": PERSON}).validate()


def test_equal_constraints_share_a_key_whatever_the_key_order():
    a = StructuredOutputs(json={"type": "object", "required": ["x"]})
    b = StructuredOutputs(json='{"required": ["x"], "type": "object"}')
    assert a.key() == b.key() and a.key() != StructuredOutputs(json_object=True).key()


@pytest.fixture(scope="module")
def smollm2():
    from hf_paged.defaults.models import load_default

    return load_default()


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tokenizer = smollm2
    return Engine(model, tokenizer=tokenizer, max_num_seqs=8)


def _prompts(tokenizer, asks):
    return [tokenizer.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
            for a in asks]


def _valid_person(text):
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
    assert len(value["name"]) <= 12 and 0 <= value["age"] <= 120


@pytest.mark.slow
def test_every_kind_of_constraint_holds_on_smollm2_greedy_and_sampled(engine, smollm2):
    tokenizer = smollm2[1]
    from hf_paged.structured.grammar import Grammars

    grammars = Grammars(tokenizer, 49152, [tokenizer.eos_token_id])
    prompts = _prompts(tokenizer, ["Describe a person called Ann as JSON.", "Who is Bob? Answer in JSON.",
                                   "Tell me about Carla."])
    cases = {
        "json": (StructuredOutputs(json=PERSON, any_whitespace=True), _valid_person),
        "json-bounded": (StructuredOutputs(json=PERSON),
                         lambda t: (_valid_person(t), " " not in t.replace('"name":"', "").split('"name":"')[0])),
        # Free-form objects: greedy, SmolLM2 rambles on keys ("family_family_name") on two of these prompts
        # whatever the whitespace; the third stops with whitespace unbounded, which this covers too.
        "json_object": (StructuredOutputs(json_object=True, any_whitespace=True), lambda t: isinstance(json.loads(t), dict)),
        "regex": (StructuredOutputs(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
                  lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t) or pytest.fail(t)),
        "choice": (StructuredOutputs(choice=["yes", "no", 'it "depends"']),
                   lambda t: t in ("yes", "no", 'it "depends"') or pytest.fail(t)),
        "grammar": (StructuredOutputs(grammar='root ::= "(" [a-z]+ ")"'),
                    lambda t: re.fullmatch(r"\([a-z]+\)", t) or pytest.fail(t)),
    }
    # Every kind greedy and sampled (n=2), each over the three prompts: one batch of 36 requests.
    runs = []
    for name, (spec, _) in cases.items():
        # Sampling at temperature 1, a 135M model may spend its budget on whitespace: bounded whitespace then.
        compact = dataclasses.replace(spec, any_whitespace=False)
        for mode, params in (("greedy", SamplingParams(max_new_tokens=96, structured=spec)),
                             ("sampled", SamplingParams(max_new_tokens=96, structured=compact, temperature=1.0,
                                                        seed=7, n=2))):
            runs += [((name, mode), params, prompt) for prompt in prompts]
    outputs = engine.generate([prompt for _, _, prompt in runs], [params for _, params, _ in runs])
    stopped = {key: 0 for key, _, _ in runs}
    for (key, params, _), out in zip(runs, outputs):
        for sample in out.outputs:
            # Every token kept to the grammar (a fresh matcher accepts them all) ...
            assert grammars.state(params.structured).accept(sample.token_ids), (key, sample.text)
            if sample.finish_reason == "stop":  # ... and the grammar ended it: it parses
                cases[key[0]][1](sample.text)
                stopped[key] += 1
    # Each kind, greedy and sampled, ended at least once (a 135M model may ramble inside a JSON object
    # until max_new_tokens).
    assert all(count >= 1 for count in stopped.values()), {k: v for k, v in stopped.items() if v == 0}


@pytest.mark.slow
def test_a_constraint_changes_only_its_own_request_in_a_batch(engine, smollm2):
    prompts = _prompts(smollm2[1], ["Name a colour.", "Count to five."])
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    mixed = [engine.generate([prompts[0]], SamplingParams(max_new_tokens=12, structured=StructuredOutputs(
        choice=["red", "blue"])))[0]]
    both = engine.generate(prompts, [SamplingParams(max_new_tokens=12, structured=StructuredOutputs(choice=["red", "blue"])),
                                     SamplingParams(max_new_tokens=12)])
    assert both[0].outputs[0].text == mixed[0].outputs[0].text in ("red", "blue")
    assert both[1].outputs[0].token_ids == plain[1].outputs[0].token_ids


@pytest.mark.slow
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_it_and_the_engine_goes_on(engine, smollm2):
    prompts = _prompts(smollm2[1], ["Hi"])
    for spec, error in [(StructuredOutputs(regex="(unclosed"), "the regex does not compile: .*parenthesis"),
                        (StructuredOutputs(grammar="root ::= undefined_rule"), "the grammar does not compile"),
                        (StructuredOutputs(json={"type": "no-such-type"}), "the json does not compile")]:
        (out,) = engine.generate(prompts, SamplingParams(structured=spec))
        assert out.finish_reason == "error" and isinstance(out.outputs[0].error, ValueError)
        assert re.match(f"structured outputs: {error}", str(out.outputs[0].error)), out.outputs[0].error
        assert "/project/" not in str(out.outputs[0].error)  # xgrammar's log prefix is cut
        with pytest.raises(ValueError, match=error):
            engine.add_request(prompts[0], SamplingParams(structured=spec))
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, structured=StructuredOutputs(choice=["ok"])))
    assert out[0].outputs[0].text == "ok"


@pytest.mark.slow
def test_an_engine_without_a_tokenizer_refuses_a_constraint(smollm2):
    engine = Engine(smollm2[0], max_num_seqs=2)
    with pytest.raises(ValueError, match="structured outputs need a tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(structured=StructuredOutputs(json_object=True)))


@pytest.mark.slow
def test_speculation_with_a_grammar_is_lossless_and_its_drafts_are_checked(smollm2):
    model, tokenizer = smollm2
    prompts = _prompts(tokenizer, ["Give two people, Ann and Ann, as JSON: Ann is 30, Ann is 30.",
                                   "Repeat the JSON {\"name\": \"Bo\", \"age\": 3} exactly."])
    params = SamplingParams(max_new_tokens=40, structured=StructuredOutputs(json=PERSON))
    plain = Engine(model, tokenizer=tokenizer, max_num_seqs=4).generate(prompts, params)
    spec_engine = Engine(model, tokenizer=tokenizer, max_num_seqs=4, speculative_method="ngram",
                         num_speculative_tokens=4)
    checked = []
    grammar_valid_prefix = None

    from hf_paged.structured.grammar import GrammarState
    grammar_valid_prefix = GrammarState.valid_prefix

    def spy(self, tokens):
        n = grammar_valid_prefix(self, tokens)
        checked.append((len(tokens), n))
        return n

    GrammarState.valid_prefix = spy
    try:
        ours = spec_engine.generate(prompts, params)
    finally:
        GrammarState.valid_prefix = grammar_valid_prefix
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]
    for o in ours:
        _valid_person(o.outputs[0].text)
    m = spec_engine.metrics()
    assert checked and m["vllm:spec_decode_num_draft_tokens"] > 0
    assert any(n < k for k, n in checked)  # some drafts broke the grammar and were cut before verification


def test_grammar_state_advances_all_or_nothing(smollm2):
    from hf_paged.structured.grammar import Grammars

    tokenizer = smollm2[1]
    grammars = Grammars(tokenizer, 49152, [tokenizer.eos_token_id])
    state = grammars.state(StructuredOutputs(choice=["yes", "no"]))
    yes, no = tokenizer.encode("yes"), tokenizer.encode("no")
    assert not state.accept(yes + no)  # "yesno" breaks it: nothing of it is kept
    assert state.valid_prefix(yes + no) == len(yes)
    assert state.accept(no + [tokenizer.eos_token_id]) and state.is_terminated
    assert grammars.num_compiled == 1
    grammars.state(StructuredOutputs(choice=["yes", "no"]))
    assert grammars.num_compiled == 1  # cached


def test_the_mask_pass_equals_xgrammars_kernel(smollm2):
    from hf_paged.structured.grammar import Grammars, GrammarMasks

    tokenizer = smollm2[1]
    grammars = Grammars(tokenizer, 49152, [tokenizer.eos_token_id])
    states = [grammars.state(StructuredOutputs(json=PERSON)) for _ in range(5)]
    prefix = tokenizer.encode('{"name": "A')
    assert states[1].accept(prefix[:1]) and states[2].accept(prefix) and states[4].accept(prefix[:2])
    torch.manual_seed(0)
    logits = torch.randn(7, 49152)
    rows = [(0, states[0], ()), (2, states[1], ()), (3, states[2], ()), (5, states[3], tuple(prefix[:2])),
            (6, states[4], ())]
    ours = logits.clone()
    GrammarMasks().apply(ours, rows)
    bitmask = xgr.allocate_token_bitmask(7, 49152)
    for row, state, extra in rows:
        if extra:
            assert state.accept(extra)
        state.matcher.fill_next_token_bitmask(bitmask, row)
        if extra:
            state.matcher.rollback(len(extra))
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, indices=[r for r, _, _ in rows], backend="cpu")
    assert torch.equal(ours, ref)
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[4], logits[4])  # unconstrained rows untouched
    assert torch.equal(ours[5].isinf(), ref[6].isinf())  # a draft row's mask: after its drafts


@pytest.mark.slow
def test_the_extraction_example_gives_the_same_valid_records_through_generate_pipeline_and_engine(smollm2):
    from example_modules import load_example

    example = load_example("structured_extraction")
    model, tokenizer = smollm2
    prompts = [example.chat(tokenizer, t) for t in example.TEXTS[:2]]
    model.set_attn_implementation("hf_paged")
    try:
        records = [example.via_generate(model, tokenizer, prompts), example.via_pipeline(model, tokenizer, prompts),
                   example.via_engine(model, tokenizer, prompts)]
    finally:
        model.set_attn_implementation("sdpa")
    assert records[0] == records[1] == records[2]
    for record in records[0]:
        assert set(record) == {"name", "role", "company"}


def test_without_xgrammar_the_error_names_the_extra(monkeypatch):
    import sys

    from hf_paged.structured import grammar

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'hf_paged\[structured\]'"):
        grammar.xgrammar()
