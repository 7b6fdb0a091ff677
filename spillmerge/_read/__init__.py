"""Reading an output: the store, filenames, index, cache, views, values, Arrow, datasets."""
