"""Front doors into the core pipeline: Dynamo/AOTAutograd (`dynamo.py`)."""
