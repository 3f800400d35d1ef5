"""Context parallelism: the sequence cut over ranks, and attention across the cuts."""
