"""Chat prompts of mixed length, shared by the demo, the benchmarks and the parity tests."""

CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red, and say one fact about each of them.",
    "I have a meeting at 3pm and another at 4:30pm, each one hour long. Do they overlap? Explain your reasoning "
    "step by step, then give a one-word answer.",
    "Summarise the plot of a story in which a young engineer builds a machine that remembers everything it has "
    "ever read, but has to decide which memories to throw away when it runs out of room. Keep it short.",
    "You are a helpful assistant for a library. A visitor asks: 'I enjoyed books about space exploration and "
    "about the history of mathematics. I am looking for something that combines both, ideally not too technical, "
    "that I could read on a long train journey next week.' Recommend what kind of book they should look for and "
    "explain why in a friendly tone.",
]


def chat_inputs(tokenizer, prompts=CHAT_PROMPTS):
    """Left-padded `input_ids`/`attention_mask` for `prompts` rendered with the chat template."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
