"""The prompt families of benchmarks/lookahead.py, written for it: retrieval-style QA over a given passage (extractive:
the answer quotes the passage's sentences, as a RAG answer with citations does), a code edit of a given snippet, and
open-ended stories."""

from __future__ import annotations

_PASSAGES = [
    """The Harbor Street Library lends books for three weeks. A book can be renewed twice, online or at the front \
desk, as long as no other member has placed a hold on it. Members who return a book late pay a fee of twenty cents \
per day, up to a maximum of five dollars per book. Children's books are never charged late fees. The library is open \
from nine in the morning to eight in the evening on weekdays, and from ten in the morning to four in the afternoon on \
Saturdays. It is closed on Sundays and on public holidays. Study rooms on the second floor can be booked for up to \
two hours per day, and a booking must be cancelled at least one hour in advance, otherwise the member cannot book \
again for one week. The library also lends laptops for use inside the building only; a laptop must be returned to \
the front desk thirty minutes before closing time.""",
    """The Greenfield community garden has forty plots, each four meters long and two meters wide. Plots are \
assigned every March by a lottery among the members who applied before the end of February. A member may hold only \
one plot at a time. Every plot holder must work three hours per season on the shared areas, such as the compost \
bins, the tool shed and the paths. Chemical pesticides are not allowed anywhere in the garden; members may use soap \
sprays and netting instead. Water is available from the taps near the gate between six in the morning and nine in \
the evening. A plot that is left unattended for more than four weeks in the growing season is given to the next \
member on the waiting list, after one written warning. The yearly fee is thirty dollars, and members over sixty-five \
pay half.""",
    """The Northline regional train runs every thirty minutes between Milford and Ashby from six in the morning to \
eleven at night. On weekends the train runs every hour. A single ticket costs four dollars and is valid for ninety \
minutes after it is first stamped. A day pass costs ten dollars and is valid on all Northline trains and on the city \
buses of Milford until midnight. Bicycles are allowed on the train outside the rush hours, which are from seven to \
nine in the morning and from four to six in the evening on weekdays. Passengers without a valid ticket pay a fine of \
sixty dollars. Lost items are kept at the Milford station office for thirty days, after which they are donated to \
charity.""",
    """The Brightwater clinic accepts new patients on Mondays and Thursdays. A first visit takes about forty-five \
minutes and includes a general check-up and a review of the patient's medication. Patients must bring a photo ID, \
their insurance card and a list of the medicines they take. Appointments can be cancelled free of charge up to \
twenty-four hours in advance; later cancellations cost twenty-five dollars. Blood tests are done between eight and \
ten in the morning, and patients should not eat for eight hours before a blood test. Results are usually available \
within three working days and can be read in the online portal. Prescriptions can be renewed through the portal, but \
a renewal takes two working days.""",
]

_TOPICS = [
    "renewing books, late fees and study rooms",
    "how plots are assigned and what every plot holder must do",
    "the ticket prices, the day pass and the rules for bicycles",
    "what a new patient must bring and the rules for blood tests",
]

RETRIEVAL = [f"Read the passage and answer the question.\n\nPassage:\n{passage}\n\nAnswer by quoting, word for word, "
             f"the sentences of the passage about {topic}."
             for passage, topic in zip(_PASSAGES, _TOPICS, strict=True)]

_SNIPPETS = [
    ("rename the function `avg` to `mean` and the parameter `xs` to `values`",
     """def avg(xs):
    total = 0
    count = 0
    for x in xs:
        total = total + x
        count = count + 1
    if count == 0:
        return 0
    return total / count


def spread(xs):
    return max(xs) - min(xs)
"""),
    ("add a docstring to every function",
     """def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, age = line.strip().split(",")
            users.append({"name": name, "age": int(age)})
    return users


def adults(users):
    return [user for user in users if user["age"] >= 18]
"""),
    ("change the class so that `withdraw` raises a ValueError when the balance is too low",
     """class Account:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        self.balance = self.balance + amount
        return self.balance

    def withdraw(self, amount):
        self.balance = self.balance - amount
        return self.balance
"""),
    ("replace the for loop in `count_words` with collections.Counter",
     """def count_words(text):
    counts = {}
    for word in text.lower().split():
        if word in counts:
            counts[word] = counts[word] + 1
        else:
            counts[word] = 1
    return counts


def top_words(text, n):
    counts = count_words(text)
    return sorted(counts.items(), key=lambda item: item[1], reverse=True)[:n]
"""),
]

CODE = [f"Edit this Python code: {task}. Reply with the complete edited code.\n\n```python\n{code}```"
        for task, code in _SNIPPETS]

STORY = [
    "Write a short story about a lighthouse keeper who finds a map hidden in an old book.",
    "Write a short story about a robot that learns to bake bread in a small village.",
    "Write a short story about two friends who get lost on a mountain hike and what they learn.",
    "Write a short story about a girl who can talk to the birds in her city.",
]

FAMILIES = {"retrieval": RETRIEVAL, "code": CODE, "story": STORY}
