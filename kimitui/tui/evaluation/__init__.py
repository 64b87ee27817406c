"""The evaluation feature without Textual widgets: the job on its worker thread (job), saved results
(store), what KL and recall run against (targets)."""
