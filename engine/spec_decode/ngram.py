"""Placeholder prompt lookup (replaced by the helper's version on merge)."""


class NgramProposer:
    needs_hidden = False

    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi

    def propose(self, seqs, max_drafts, hidden=None):
        out = []
        for seq, k in zip(seqs, max_drafts):
            toks = seq.token_ids
            draft = []
            for n in range(self.hi, self.lo - 1, -1):
                if len(toks) <= n:
                    continue
                tail = toks[-n:]
                for i in range(len(toks) - n - 1, -1, -1):
                    if toks[i:i + n] == tail:
                        draft = toks[i + n: i + n + k]
                        break
                if draft:
                    break
            out.append(draft)
        return out

    def finish(self, seq_id):
        pass
