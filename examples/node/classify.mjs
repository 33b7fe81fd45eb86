// Classify images with a vit_hub model from Node.js, no Python:
//
//   node classify.mjs MODEL_DIR IMAGE [IMAGE ...]
//
// MODEL_DIR holds pipeline.onnx and config.json (what `python -m vit_hub.export` writes). The
// graph does all the preprocessing itself, so the app only decodes each image to its pixels:
// uint8 [height, width, channels] in, probabilities in config.json's label order out.
// Prints one JSON line per image: {file, label, top: [[label, probability], ...]} or {file, error}.
import { readFile } from "node:fs/promises";
import path from "node:path";
import * as ort from "onnxruntime-node";
import sharp from "sharp";

const TOP_K = 3;

async function decode(file) {
  // rotate(): apply the EXIF orientation, as a phone photo is meant to be seen.
  const { data, info } = await sharp(file).rotate().raw().toBuffer({ resolveWithObject: true });
  return new ort.Tensor("uint8", data, [info.height, info.width, info.channels]);
}

// Another model's graph gives probabilities for other classes: what is wrong, or null.
function labelsMismatch(session, labels) {
  const shape = session.outputMetadata.find((value) => value.name === "probabilities")?.shape;
  if (Array.isArray(labels) && shape?.length === 1 && shape[0] === labels.length) return null;
  return `expected pipeline.onnx to give one probability per label of config.json (${labels?.length} labels), ` +
    `found probabilities of shape ${JSON.stringify(shape ?? null)}; export the graph from this model dir`;
}

async function main([modelDir, ...files]) {
  if (!modelDir || files.length === 0) {
    console.error("usage: node classify.mjs MODEL_DIR IMAGE [IMAGE ...]");
    return 2;
  }
  const { labels } = JSON.parse(await readFile(path.join(modelDir, "config.json"), "utf8"));
  const session = await ort.InferenceSession.create(path.join(modelDir, "pipeline.onnx"));
  const mismatch = labelsMismatch(session, labels);
  if (mismatch) {
    console.error(`error: ${mismatch}`);
    return 2;
  }
  for (const file of files) {
    try {
      const { probabilities } = await session.run({ image: await decode(file) });
      const top = Array.from(probabilities.data, (probability, index) => [labels[index], probability])
        .sort((a, b) => b[1] - a[1])
        .slice(0, TOP_K);
      console.log(JSON.stringify({ file, label: top[0][0], top }));
    } catch (error) {
      // A refused image (no ink, too large, 5 channels) or an undecodable file: its own line.
      console.log(JSON.stringify({ file, error: error.message.split("\n")[0] }));
    }
  }
  return 0;
}

process.exitCode = await main(process.argv.slice(2));
