"""Model families, each built from the parallel layers and declaring how checkpoint names map in."""
