"""specplug-mtp: the `mtp` speculator (a trained MTP head drafting from the target's final hidden
state), its trainer (`specplug train mtp`) and the heads it ships (`heads/`)."""
