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


# Plain prose for prompts of a chosen length (about 700 tokens with SmolLM2's tokenizer).
PASSAGE = (
    "The lighthouse keeper kept a logbook for forty years. Every evening she wrote down the weather, the ships "
    "that passed, and one small thing she had noticed that day: a gull with a crooked wing, a change in the colour "
    "of the lichen on the north wall, the smell of rain arriving before the clouds did. When the lighthouse was "
    "automated, the logbooks were boxed up and sent to the county archive, where nobody read them for a long time. "
    "Years later a student of climate history found the boxes while looking for something else. She noticed that "
    "the keeper had recorded the first frost of every autumn and the day the swallows left, and that both dates "
    "had drifted, slowly but steadily, across four decades. The drift matched the instrument records from the "
    "nearest weather station, but the logbooks went back further and had fewer gaps. The student spent a winter "
    "transcribing them into a spreadsheet, checking each entry against tide tables and newspaper reports of storms. "
    "Some entries were puzzling. On one night the keeper wrote that the sea had glowed green for an hour; on "
    "another, that she had heard singing from a boat that was not there. The student marked these as anomalies and "
    "moved on, but a marine biologist who read her thesis recognised the green glow as a bloom of bioluminescent "
    "plankton, and found three other reports of the same bloom along the coast that week. The singing remained a "
    "mystery. In the end the thesis had two parts. The first was careful and quantitative: tables of dates, trend "
    "lines, confidence intervals, a discussion of how a single observer's habits might bias the record. The second "
    "part was shorter and stranger. It argued that long, patient, unglamorous observation by one person in one "
    "place is a kind of instrument too, with its own calibration and its own noise, and that science loses "
    "something when it only trusts the readings of machines. The examiners argued about the second part for an "
    "afternoon and then passed it. A copy of the thesis now sits in the lighthouse, which has become a small "
    "museum, next to the first logbook. Visitors are allowed to turn its pages with cotton gloves. Most of them "
    "read the entry about the singing, and many of them stand for a while at the window afterwards, looking at the "
    "water, as if they might hear it too. The museum also keeps a guest book, and in it people have started to "
    "write down one small thing they noticed that day: the colour of the sea, a ship on the horizon, the wind "
    "turning cold before a storm, a child asleep on a bench in the sun."
)


def mixed_length_prompts(tokenizer, num_prompts: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chat-templated prompts (token ids) of lengths drawn uniformly from [min_tokens, max_tokens].

    Each asks a question about a slice of `PASSAGE` (repeated as needed), starting at a different
    offset, so prompts share the chat template's system prefix but little else. Lengths too short for
    the template (about 40 tokens with SmolLM2's) get a bare slice of the passage.
    """
    import random

    rng = random.Random(seed)
    marker = "@@CONTENT@@"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
    before, after = rendered.split(marker)
    head = tokenizer(before + "Answer briefly: what is this text about?\n\n", add_special_tokens=False)["input_ids"]
    tail = tokenizer(after, add_special_tokens=False)["input_ids"]
    body = tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    prompts = []
    for _ in range(num_prompts):
        target = rng.randint(min_tokens, max_tokens)
        start = rng.randrange(len(body))
        # Too short for the template: a plain-text continuation prompt instead.
        n = target - len(head) - len(tail) if target > len(head) + len(tail) else target
        text_ids = (body * (2 + n // len(body)))[start : start + n]
        prompts.append(head + text_ids + tail if n != target else text_ids)
    return prompts
