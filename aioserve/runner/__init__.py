"""The model runner: builds each step's device inputs, runs the model, samples."""
