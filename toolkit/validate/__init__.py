"""Validators: the libraries' own config classes plus the rules they only check at launch."""
