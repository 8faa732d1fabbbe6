"""pretrain: the moe-stack training application (the ``pretrain`` command)."""
