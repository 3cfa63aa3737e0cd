"""The mixed prompt set the correctness tests and the fidelity benchmark share: 24 (prompt, max_tokens) cases of
mixed lengths and kinds (prose, code, a list, a table, a chat-formatted prompt), and the texts they are built from.
"""

from __future__ import annotations

PARAGRAPHS = [
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "built wooden running machines that riders pushed along with their feet. Pedals attached to the front "
    "wheel came decades later, and the chain drive that powers modern bicycles was only perfected in the "
    "1880s. Within a few years, cycling clubs had appeared in almost every large city, and the bicycle "
    "changed how ordinary people travelled to work, visited friends and explored the countryside.",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical "
    "energy. Inside the chloroplasts, chlorophyll absorbs sunlight and uses its energy to split water "
    "molecules, releasing oxygen. The hydrogen and the energy captured in this way are then used to convert "
    "carbon dioxide from the air into sugars, which the plant uses to grow. In short, photosynthesis",
    "Dear hiring manager,\n\nI am writing to apply for the position of junior software engineer at your "
    "company. During my studies I built several web applications, contributed to two open source projects "
    "and worked as a teaching assistant for the introductory programming course. I enjoy solving problems "
    "with other people and I learn new tools quickly. I would welcome the chance to",
]

CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result


def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
'''

LIST = (
    "Shopping list for the week:\n1. Apples\n2. Bread\n3. Milk\n4. Eggs\n5. Rice\n6. Tomatoes\n7. Onions\n"
    "8. Cheese\n9. Coffee\n10. Pasta\n11. Olive oil\n12. Carrots\n13. Yogurt\n14. Bananas\n15. Chicken\n16."
)

TABLE = (
    "| Country | Capital | Continent |\n|---|---|---|\n| France | Paris | Europe |\n| Japan | Tokyo | Asia |\n"
    "| Kenya | Nairobi | Africa |\n| Brazil | Brasilia | South America |\n| Canada | Ottawa | North America |\n"
    "| Australia | Canberra | Oceania |\n| Germany | Berlin | Europe |\n| India |"
)

CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat are three good habits for staying healthy?<|im_end|>\n<|im_start|>assistant\n"
)

# (prompt, max_tokens): 24 cases of mixed lengths (7 of them longer than LONG_PROMPT_TOKENS tokens, so the
# integration suite's `llm` variant prefills them in chunks) and mixed max_tokens (8 to 40).
MIXED_CASES: list[tuple[str, int]] = [
    ("The capital of France is", 8),
    ("Once upon a time, in a small village by the sea,", 24),
    ("def fibonacci(n):", 32),
    ("The three primary colors are", 12),
    ("Water boils at", 10),
    (PARAGRAPHS[0] + " The next big change came", 32),
    (PARAGRAPHS[1], 24),
    (PARAGRAPHS[2], 40),
    (CODE, 40),
    (LIST, 20),
    (TABLE, 16),
    (CHAT, 40),
    ("List five animals that live in the ocean:\n1.", 30),
    ("Translate to French: 'Good morning, how are you?'\nFrench:", 16),
    ("The quick brown fox", 8),
    ("In mathematics, a prime number is", 28),
    (PARAGRAPHS[0] + "\n\n" + PARAGRAPHS[1] + "\n\nQuestion: what do the two texts above describe?\nAnswer:", 20),
    ("import numpy as np\n\n# Compute the mean of each row of a matrix\n", 24),
    ("Q: What is 12 times 12?\nA:", 8),
    ("My favourite season is autumn because", 36),
    ("Here is a haiku about the moon:\n", 20),
    ("SELECT name, email FROM users WHERE", 16),
    ("The most important invention of the twentieth century was", 40),
    ("1, 2, 3, 5, 8, 13, 21,", 12),
]

LONG_PROMPT_TOKENS = 64  # the integration suite's `llm` variant's max_num_batched_tokens
