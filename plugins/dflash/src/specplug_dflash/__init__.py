"""specplug-dflash: the `dflash` block speculator, its trainer (`specplug train dflash`) and the
heads it ships (`heads/`)."""
