"""One rank's step: batch tensors, the model's forward (graphed or eager), sampling."""
