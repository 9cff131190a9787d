// Test input copied from microsoft/aici (MIT License): controllers/jsctrl/samples/hellots.ts @ ecc50362fe2c; program unchanged below.
async function main() {
    await $`Hello`
    await gen({ regex: / [A-Z]+/ })
}

start(main)
