"""A literal depth-D suffix trie with arctic-inference's speculation rule, as the oracle for
engine/spec_decode/suffix.py (which derives the same counts from token arrays instead).

Every suffix of every inserted sequence is walked for at most D tokens; each node counts the
suffixes through it and remembers the latest (largest) position it ended at, which breaks count ties
the way the proposer does (most recent occurrence). Positions are global across sequences in
insertion order, as the proposer's global cache numbers them.
"""


class Node:
    __slots__ = ("children", "count", "last")

    def __init__(self):
        self.children = {}
        self.count = 0
        self.last = -1


class SuffixTrie:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()
        self.offset = 0

    def insert(self, seq: list[int]) -> None:
        for i in range(len(seq)):
            node = self.root
            for j in range(i, min(i + self.depth, len(seq))):
                node = node.children.setdefault(seq[j], Node())
                node.count += 1
                node.last = max(node.last, self.offset + j)
        self.offset += len(seq) + 1

    def _match(self, pattern):
        node = self.root
        for t in pattern:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def _path(self, node, max_tokens, min_prob):
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < max_tokens and node.children:
            tok, child = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].last))
            prob *= child.count / node.count
            if prob < min_prob:
                break
            draft.append(tok)
            score += prob
            node = child
        return draft, score

    def speculate(self, pattern: list[int], max_spec: int, factor: float, min_prob: float):
        """arctic-inference's SuffixTree::speculate over match lengths 1 .. len(pattern) - 1."""
        best, best_score = [], 0.0
        for m in range(1, len(pattern)):
            node = self._match(pattern[len(pattern) - m :])
            if node is None:
                break
            max_tokens = min(max_spec, int(m * factor + 1e-6))
            draft, score = self._path(node, max_tokens, min_prob)
            if score >= best_score:
                best, best_score = draft, score
        return best, best_score
