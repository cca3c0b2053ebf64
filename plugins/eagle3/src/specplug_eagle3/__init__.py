"""specplug-eagle3: the `eagle3` speculator, its trainer (`specplug train eagle3`), the importer of
public EAGLE-3 checkpoints (`specplug convert eagle3`) and the heads it ships (`heads/`)."""
