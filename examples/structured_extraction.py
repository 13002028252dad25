"""Extract records from text into a JSON schema with SmolLM2-135M-Instruct, four ways.

    python examples/structured_extraction.py [--no-server]

Each answer is held to the schema by a grammar (xgrammar, the `structured` extra), so every record
parses and validates, even from a 135M model:

  1. drop-in `model.generate(..., logits_processor=[GrammarLogitsProcessor(...)])` (the engine runs it);
  2. `pipeline("text-generation", ...)` with the same processor;
  3. `Engine.generate` with `SamplingParams(structured=StructuredOutputs(json=schema))`;
  4. `hf-paged serve` with the openai client's `response_format={"type": "json_schema", ...}`.

Greedy, the four give the same records.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import torch
from transformers import pipeline

from hf_paged import Engine, SamplingParams, StructuredOutputs
from hf_paged.defaults.models import load_default
from hf_paged.structured import GrammarLogitsProcessor

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 32}, "role": {"type": "string", "maxLength": 32},
    "company": {"type": "string", "maxLength": 32}}, "required": ["name", "role", "company"],
    "additionalProperties": False}
TEXTS = ["Ada Lovelace joined Analytical Engines Ltd as chief mathematician.",
         "After ten years at Globex, Hank Scorpio is now its CEO.",
         "Our new intern, Priya Nair, works on the data team at Initech.",
         "Jean Dupont, head baker at Boulangerie Soleil, opens the shop at six."]


def chat(tokenizer, text: str) -> str:
    ask = f"Extract the person, their role and their company from this text as JSON: {text}"
    return tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True)


def via_generate(model, tokenizer, prompts) -> list[dict]:
    processor = GrammarLogitsProcessor(tokenizer, StructuredOutputs(json=SCHEMA))
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=64, do_sample=False, logits_processor=[processor])
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"  engine steps: {model.hf_paged_last_metrics['num_steps']}")
    return [json.loads(t) for t in texts]


def via_pipeline(model, tokenizer, prompts) -> list[dict]:
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    processor = GrammarLogitsProcessor(tokenizer, StructuredOutputs(json=SCHEMA))  # one, reused per prompt
    outs = pipe(prompts, max_new_tokens=64, do_sample=False, return_full_text=False, logits_processor=[processor])
    return [json.loads(o[0]["generated_text"]) for o in outs]


def via_engine(model, tokenizer, prompts) -> list[dict]:
    engine = Engine(model, tokenizer=tokenizer, max_num_seqs=8)
    params = SamplingParams(max_new_tokens=64, structured=StructuredOutputs(json=SCHEMA))
    return [json.loads(o.outputs[0].text) for o in engine.generate(prompts, params)]


def via_server(texts) -> list[dict] | None:
    try:
        import openai
    except ImportError:
        print("  (skipped: pip install 'hf_paged[serve]' openai)")
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "hf_paged.cli", "serve", "default", "--port", str(port),
                               "--served-model-name", "smollm2"], stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for _ in range(600):
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.2)
        records = []
        for text in texts:
            ask = f"Extract the person, their role and their company from this text as JSON: {text}"
            answer = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": ask}], max_tokens=64, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA,
                                                                        "strict": True}})
            records.append(json.loads(answer.choices[0].message.content))
        return records
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-server", action="store_true", help="skip the server (4.)")
    args = parser.parse_args()
    model, tokenizer = load_default(dtype=torch.float32, attn_implementation="hf_paged")
    prompts = [chat(tokenizer, t) for t in TEXTS]
    results = {}
    for name, run in [("generate", lambda: via_generate(model, tokenizer, prompts)),
                      ("pipeline", lambda: via_pipeline(model, tokenizer, prompts)),
                      ("engine", lambda: via_engine(model, tokenizer, prompts)),
                      ("server", None if args.no_server else lambda: via_server(TEXTS))]:
        if run is None:
            continue
        print(f"{name}:")
        records = run()
        if records is None:
            continue
        for record in records:
            print("  ", json.dumps(record))
        results[name] = records
    same = all(r == results["generate"] for r in results.values())
    print(f"\nthe same records every way: {same}")


if __name__ == "__main__":
    main()
