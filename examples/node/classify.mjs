// Classify images with a vit_hub model from Node.js, no Python:
//
//   node classify.mjs MODEL_DIR IMAGE [IMAGE ...]
//   node classify.mjs MODEL_DIR IMAGE --map overlay.png
//
// MODEL_DIR holds pipeline.onnx and config.json (what `python -m vit_hub.export` writes). The
// graph does all the preprocessing itself, so the app only decodes each image to its pixels:
// uint8 [height, width, channels] in, probabilities in config.json's label order out.
// Prints one JSON line per image: {file, label, top: [[label, probability], ...]} or {file, error}.
//
// With --map (one IMAGE), it runs pipeline_map.onnx instead (an export with --output-attentions
// writes it), adds the map [grid_h][grid_w] to the line and writes the app's overlay as a PNG:
// over the image the model saw for a digit model (its canonicalised digit), over the upload
// for any other. The drawing is ../../vit_hub/hub/static_page/overlay.mjs, the static Space's.
import { existsSync } from "node:fs";
import { readFile } from "node:fs/promises";
import path from "node:path";
import * as ort from "onnxruntime-node";
import sharp from "sharp";
import { displaySize, forDisplay, overlay } from "../../vit_hub/hub/static_page/overlay.mjs";

const TOP_K = 3;
const USAGE = "usage: node classify.mjs MODEL_DIR IMAGE [IMAGE ...] | MODEL_DIR IMAGE --map OUT.png";

async function decode(file) {
  // rotate(): apply the EXIF orientation, as a phone photo is meant to be seen.
  const { data, info } = await sharp(file).rotate().raw().toBuffer({ resolveWithObject: true });
  return new ort.Tensor("uint8", data, [info.height, info.width, info.channels]);
}

// Another model's graph gives probabilities for other classes: what is wrong, or null.
function labelsMismatch(session, labels, name) {
  const shape = session.outputMetadata.find((value) => value.name === "probabilities")?.shape;
  if (Array.isArray(labels) && shape?.length === 1 && shape[0] === labels.length) return null;
  return `expected ${name} to give one probability per label of config.json (${labels?.length} labels), ` +
    `found probabilities of shape ${JSON.stringify(shape ?? null)}; export the graph from this model dir`;
}

function ranked(probabilities, labels) {
  return Array.from(probabilities.data, (probability, index) => [labels[index], probability])
    .sort((a, b) => b[1] - a[1])
    .slice(0, TOP_K);
}

// What the app draws the map over, no larger than its display size: the image the model saw
// for a digit model, else the upload (a large one shrunk bilinearly, as the app does).
async function underTheMap(answer, image, config) {
  const base = config.canonicalize === "digit" ? answer.model_input : image;
  const [height, width, channels] = base.dims;
  const [shownWidth, shownHeight] = displaySize(width, height);
  if (shownWidth >= width) return { pixels: base.data, height, width, channels };
  const { data, info } = await sharp(base.data, { raw: { width, height, channels } })
    .resize(shownWidth, shownHeight, { fit: "fill", kernel: "linear" }).raw().toBuffer({ resolveWithObject: true });
  return { pixels: data, height: info.height, width: info.width, channels: info.channels };
}

// The overlay PNG of one answer of pipeline_map.onnx; returns the map as rows.
async function writeOverlay(answer, image, config, out) {
  const [gridH, gridW] = answer.map.dims;
  const { pixels: base, height, width, channels } = await underTheMap(answer, image, config);
  const shown = forDisplay(base, height, width, channels, config.in_channels === 1);
  const pixels = overlay(shown, answer.map.data, gridH, gridW, answer.map_colours.data);
  await sharp(Buffer.from(pixels), { raw: { width: shown.width, height: shown.height, channels: 3 } }).png().toFile(out);
  return Array.from({ length: gridH }, (_, row) => Array.from(answer.map.data.slice(row * gridW, (row + 1) * gridW)));
}

async function main(argv) {
  const at = argv.indexOf("--map");
  const mapOut = at >= 0 ? argv[at + 1] : null;
  const [modelDir, ...files] = at >= 0 ? [...argv.slice(0, at), ...argv.slice(at + 2)] : argv;
  if (!modelDir || files.length === 0 || (at >= 0 && (!mapOut || files.length !== 1))) {
    console.error(USAGE);
    return 2;
  }
  const config = JSON.parse(await readFile(path.join(modelDir, "config.json"), "utf8"));
  const graph = path.join(modelDir, mapOut ? "pipeline_map.onnx" : "pipeline.onnx");
  if (!existsSync(graph)) {
    console.error(`expected ${path.basename(graph)} in ${modelDir}, found none: write it with python -m vit_hub.export `
      + `--model ${modelDir} --out ${modelDir}${mapOut ? " --output-attentions" : ""}`);
    return 2;
  }
  const session = await ort.InferenceSession.create(graph);
  const mismatch = labelsMismatch(session, config.labels, path.basename(graph));
  if (mismatch) {
    console.error(`error: ${mismatch}`);
    return 2;
  }
  for (const file of files) {
    try {
      const image = await decode(file);
      const answer = await session.run({ image });
      const top = ranked(answer.probabilities, config.labels);
      const map = mapOut ? { map: await writeOverlay(answer, image, config, mapOut), overlay: mapOut } : {};
      console.log(JSON.stringify({ file, label: top[0][0], top, ...map }));
    } catch (error) {
      // A refused image (no ink, too large, 5 channels) or an undecodable file: its own line.
      console.log(JSON.stringify({ file, error: error.message.split("\n")[0] }));
    }
  }
  return 0;
}

process.exitCode = await main(process.argv.slice(2));
