"""`diloco report`: plots of one run folder and a side-by-side comparison of several."""
